"""Prompt datasets: load rows from local files, check them, format and tokenize prompts, and serve them in a
deterministic, resumable order.

Sources are read by tasks/sources.py (`.jsonl`, `.json`, `.parquet`, a `save_to_disk` directory). Every row
is checked up front, and a bad row is a `ValueError` that names its index and field, not a crash twenty
minutes into a run. A numeric gold answer becomes positional text (`0.00005`, `10000000000000000`, `72`
for 72.0), never Python's `5e-05`, which answer checkers read as an expression in Euler's e. Prompts are
wrapped in the tokenizer's chat template when it has one (configurable), else in a plain template string.
Prompts longer than `max_prompt_tokens` are dropped and counted in the log, or refused, by config. A
held-out split (`eval_fraction`) takes whole prompts: every row of a prompt that appears more than once
lands on the same side.

`PromptDataset` hands out prompts epoch by epoch in a seeded permutation; its `state_dict()` is the
(epoch, position) a checkpoint needs to continue exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from posttrain.config import Config
from posttrain.logging import get_logger
from posttrain.tasks.cursor import PromptCursor
from posttrain.tasks.sources import load_rows, saved_splits

logger = get_logger(__name__)

PROMPT_PLACEHOLDER = "{prompt}"


class PromptFormatConfig(Config):
    """How a task's raw prompt text becomes the token ids the policy sees."""

    template: str = Field(
        PROMPT_PLACEHOLDER,
        description="Text around the raw prompt; '{prompt}' is replaced by it (other braces are kept as "
        "they are, so LaTeX like \\boxed{} needs no escaping). With a chat template this is the user message.",
    )
    system_prompt: str | None = Field(None, description="System message, used only with a chat template.")
    chat_template: Literal["auto", "always", "never"] = Field(
        "auto",
        description="auto: use the tokenizer's chat template when it has one. always: require one. "
        "never: use the plain template only.",
    )
    prepend_bos: bool = Field(
        True,
        description="Start every prompt with the tokenizer's BOS token (if it has one and it is not there).",
    )
    max_prompt_tokens: int = Field(512, ge=1, description="Longest prompt, in tokens, that fits the context.")
    overlong_prompts: Literal["drop", "error"] = Field(
        "drop",
        description="drop: leave out prompts longer than max_prompt_tokens and log how many. error: refuse to "
        "build the dataset.",
    )

    @field_validator("template")
    @classmethod
    def _has_placeholder(cls, value: str) -> str:
        if PROMPT_PLACEHOLDER not in value:
            raise ValueError(f"the template must contain {PROMPT_PLACEHOLDER!r}, e.g. 'Q: {{prompt}}\\nA:'")
        return value


class DatasetConfig(Config):
    """Where a dataset task's prompts come from and which fields they use."""

    train_path: str = Field(
        description="A .jsonl, .json or .parquet file, or a directory saved by datasets.save_to_disk."
    )
    eval_path: str | None = Field(
        None, description="Held-out prompts (same formats); see also eval_split and eval_fraction."
    )
    train_split: str | None = Field(None, description="Split to use when train_path holds a DatasetDict.")
    eval_split: str | None = Field(
        None,
        description="Split of eval_path's DatasetDict to hold out; without eval_path, a split of "
        "train_path's DatasetDict (e.g. train_split=train, eval_split=test).",
    )
    eval_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Without eval_path or eval_split: hold out this fraction of the training rows, whole "
        "prompts at a time (a prompt's repeats all land on one side; chosen by the seed).",
    )
    prompt_field: str = Field("problem", description="Field holding the prompt (problem) text.")
    answer_field: str | None = Field(
        "answer", description="Field holding the gold answer, passed to the reward as metadata['answer']."
    )
    metadata_fields: list[str] = Field(
        default_factory=list,
        description="Further fields copied into each prompt's metadata for the reward (not 'problem', nor "
        "'answer' while answer_field sets it).",
    )
    max_rows: int | None = Field(None, ge=1, description="Use only the first max_rows rows of each source.")

    @model_validator(mode="after")
    def _check(self) -> DatasetConfig:
        _refuse_own_metadata(self)
        held = [f"{key}={getattr(self, key)!r}" for key in ("eval_path", "eval_split") if getattr(self, key)]
        if self.eval_fraction > 0 and held:
            raise ValueError(
                f"eval_fraction={self.eval_fraction} holds out training rows, but {' and '.join(held)} "
                "already names the held-out prompts; set eval_fraction=0, or drop eval_path and eval_split"
            )
        if self.eval_path is None and self.eval_split is not None and self.eval_split == self.train_split:
            raise ValueError(
                f"eval_split={self.eval_split!r} is train_split: without eval_path the held-out prompts "
                "would be the training prompts; name another split of train_path, or set eval_path"
            )
        return self


def _refuse_own_metadata(cfg: DatasetConfig) -> None:
    """Refuse metadata_fields that would overwrite what the dataset itself puts in metadata."""
    own = {"problem": f"the prompt text (prompt_field={cfg.prompt_field!r})"}
    if cfg.answer_field is not None:
        own["answer"] = f"the gold answer (answer_field={cfg.answer_field!r})"
    for name in cfg.metadata_fields:
        if name not in own:
            continue
        hint = ""
        if name == "answer" and cfg.answer_field != "answer":
            hint = " (or set answer_field='answer' to make that column the gold answer)"
        raise ValueError(
            f"metadata_fields names {name!r}, but metadata[{name!r}] holds {own[name]} and would be "
            f"overwritten; remove {name!r} from metadata_fields{hint}"
        )


@dataclass(frozen=True)
class SourcePrompt:
    """A raw prompt before formatting: a stable id (row index), its text and metadata for the reward."""

    prompt_id: int
    text: str
    metadata: dict[str, Any]


@dataclass(frozen=True)
class PromptItem:
    """One prompt as the training loop sees it.

    `prompt_id` is stable within its dataset (the source row index), `prompt` is the formatted text,
    `prompt_token_ids` its tokens, and `metadata` what the reward function gets for it (the gold answer
    under 'answer', the raw prompt under 'problem'). `repeat` counts the earlier draws of this prompt
    at the same weights (in one synchronous step, or while one weight version is out): 0 for the first;
    the loops set it (`RepeatCounter`) so that a prompt drawn twice gets a seed of its own.
    """

    prompt_id: int
    prompt: str
    prompt_token_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)
    repeat: int = 0


class RepeatCounter:
    """Numbers the draws of each prompt at one weight version (0, 1, ...), starting over when the
    version changes: the `repeat` of PromptItem that keeps two draws of one prompt at the same weights
    from sharing a group seed. One counter lives as long as its run (a step that trains nothing keeps
    the version, so the next step's draws count on) and is saved with it (`state_dict`)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.counts: Counter[int] = Counter()

    def next(self, prompt_id: int, weight_version: int) -> int:
        """How many times `prompt_id` was drawn at `weight_version` before this draw."""
        if weight_version != self.version:
            self.version, self.counts = weight_version, Counter()
        n = self.counts[prompt_id]
        self.counts[prompt_id] = n + 1
        return n

    def state_dict(self) -> dict[str, Any]:
        """The version counted and each prompt's draws at it (JSON-safe: a checkpoint's loop state)."""
        return {"version": self.version, "counts": sorted(self.counts.items())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.version = state["version"]
        self.counts = Counter({int(p): int(n) for p, n in state["counts"]})

    def mark(self, item: PromptItem, weight_version: int) -> PromptItem:
        """`item` as this draw of it: the same object on its first draw at this version, else a copy
        with its `repeat` set."""
        return as_repeat(item, self.next(item.prompt_id, weight_version))


def as_repeat(item: PromptItem, repeat: int) -> PromptItem:
    """`item` drawn for the `repeat`-th time at the same weights: itself for 0, else a copy with it set."""
    return item if repeat == 0 else replace(item, repeat=repeat)


def _field(row: Mapping[str, Any], index: int, name: str, source: str) -> Any:
    if name not in row:
        raise ValueError(
            f"{source}: row {index} has no field '{name}' (it has: {', '.join(map(str, row)) or 'none'}); "
            "fix the row or set the dataset's field names to the right columns"
        )
    value = row[name]
    if value is None or isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{source}: row {index} field '{name}' is null")
    return value


def answer_text(value: Any) -> str:
    """A gold answer as text: a float written positionally (0.00005, 10000000000000000, 72 for 72.0), not
    as Python's str() writes it ('5e-05', '1e+16'), which math-verify reads as 5*E - 5 (Euler's e)."""
    if isinstance(value, float) and math.isfinite(value):
        return np.format_float_positional(value + 0.0, trim="-")  # + 0.0: -0.0 is written '0'
    return str(value)


def _text_field(row: Mapping[str, Any], index: int, name: str, source: str, numbers_ok: bool) -> str:
    value = _field(row, index, name, source)
    allowed = (str, int, float) if numbers_ok else (str,)
    if isinstance(value, bool) or not isinstance(value, allowed):
        kinds = "a string or a number" if numbers_ok else "a string"
        raise ValueError(f"{source}: row {index} field '{name}' must be {kinds}, got {type(value).__name__}")
    text = answer_text(value)
    if not text.strip():
        raise ValueError(f"{source}: row {index} field '{name}' is empty")
    return text


def rows_to_prompts(rows: Sequence[Any], cfg: DatasetConfig, source: str) -> list[SourcePrompt]:
    """Check every row and turn it into a SourcePrompt whose id is the row index."""
    out = []
    for index, row in enumerate(rows[: cfg.max_rows] if cfg.max_rows else rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"{source}: row {index} is a {type(row).__name__}, not an object with fields")
        text = _text_field(row, index, cfg.prompt_field, source, numbers_ok=False)
        metadata: dict[str, Any] = {"problem": text}
        if cfg.answer_field is not None:
            metadata["answer"] = _text_field(row, index, cfg.answer_field, source, numbers_ok=True)
        for name in cfg.metadata_fields:
            metadata[name] = _field(row, index, name, source)
        out.append(SourcePrompt(prompt_id=index, text=text, metadata=metadata))
    if not out:
        raise ValueError(f"{source} has no rows")
    return out


_WARNED: set[str] = set()  # warnings given once per process


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def uses_chat_template(tokenizer: Any, fmt: PromptFormatConfig) -> bool:
    """Whether prompts go through the tokenizer's chat template (warns once that a system prompt is
    unused when they do not)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if fmt.chat_template == "always" and not has_template:
        raise ValueError(
            "chat_template=always but the tokenizer has no chat_template; set chat_template to auto or never"
        )
    use_chat = has_template and fmt.chat_template != "never"
    if fmt.system_prompt and not use_chat:
        why = "chat_template=never" if has_template else "the tokenizer has no chat template"
        _warn_once(
            f"prompt_format.system_prompt is not used: {why}, and only a chat template has a system message. "
            "Put its text in prompt_format.template, or remove system_prompt"
        )
    return use_chat


def format_prompt(text: str, tokenizer: Any, fmt: PromptFormatConfig, use_chat: bool) -> str:
    """The prompt text the model sees: the template around `text`, inside the chat template if used."""
    user = fmt.template.replace(PROMPT_PLACEHOLDER, text)
    if not use_chat:
        return user
    messages = [{"role": "system", "content": fmt.system_prompt}] if fmt.system_prompt else []
    messages.append({"role": "user", "content": user})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def tokenize_prompts(
    texts: list[str], tokenizer: Any, fmt: PromptFormatConfig, use_chat: bool
) -> list[list[int]]:
    """Token ids per prompt. Chat-templated text already holds its special tokens, so none are added."""
    if not texts:
        return []
    ids = [list(x) for x in tokenizer(texts, add_special_tokens=not use_chat)["input_ids"]]
    bos = getattr(tokenizer, "bos_token_id", None)
    if fmt.prepend_bos and bos is not None:
        ids = [x if x[:1] == [bos] else [bos, *x] for x in ids]
    return ids


def prompt_token_ids(texts: list[str], tokenizer: Any, fmt: PromptFormatConfig) -> list[list[int]]:
    """Token ids of raw prompt texts as a task with prompt format `fmt` gives them to the policy: the
    template around each (inside the tokenizer's chat template when used), then BOS as `fmt` says."""
    use_chat = uses_chat_template(tokenizer, fmt)
    formatted = [format_prompt(text, tokenizer, fmt, use_chat) for text in texts]
    return tokenize_prompts(formatted, tokenizer, fmt, use_chat)


def fitting_prompts(
    lengths: Sequence[int], ids: Sequence[int], fmt: PromptFormatConfig, name: str
) -> list[int]:
    """Positions of the prompts (token counts `lengths`, rows `ids` for the messages) no longer than
    `fmt.max_prompt_tokens`; longer ones are dropped and logged, or refused (`overlong_prompts=error`)."""
    limit = fmt.max_prompt_tokens
    over = [i for i, n in enumerate(lengths) if n > limit]
    if not over:
        return list(range(len(lengths)))
    longest = max(lengths[i] for i in over)
    rows = ", ".join(str(ids[i]) for i in over[:10]) + (", ..." if len(over) > 10 else "")
    if fmt.overlong_prompts == "error":
        raise ValueError(
            f"{len(over)} of {len(lengths)} {name} prompts are longer than max_prompt_tokens={limit} (longest "
            f"{longest} tokens; rows {rows}). Raise max_prompt_tokens to at least {longest} or set "
            "overlong_prompts=drop."
        )
    logger.warning(
        "dropped %d of %d %s prompts longer than max_prompt_tokens=%d (longest %d tokens; rows %s)",
        len(over),
        len(lengths),
        name,
        limit,
        longest,
        rows,
    )
    if len(over) == len(lengths):
        raise ValueError(
            f"every {name} prompt is longer than max_prompt_tokens={limit}; raise it to {longest}"
        )
    dropped = set(over)
    return [i for i in range(len(lengths)) if i not in dropped]


def _drop_overlong(items: list[PromptItem], fmt: PromptFormatConfig, name: str) -> list[PromptItem]:
    lengths = [len(it.prompt_token_ids) for it in items]
    return [items[i] for i in fitting_prompts(lengths, [it.prompt_id for it in items], fmt, name)]


def build_prompt_dataset(
    sources: list[SourcePrompt],
    tokenizer: Any,
    fmt: PromptFormatConfig,
    *,
    seed: int = 0,
    shuffle: bool = True,
    name: str = "train",
) -> PromptDataset:
    """Format, tokenize and length-filter `sources` into a PromptDataset."""
    use_chat = uses_chat_template(tokenizer, fmt)
    texts = [format_prompt(s.text, tokenizer, fmt, use_chat) for s in sources]
    token_ids = tokenize_prompts(texts, tokenizer, fmt, use_chat)
    items = [
        PromptItem(prompt_id=s.prompt_id, prompt=t, prompt_token_ids=ids, metadata=s.metadata)
        for s, t, ids in zip(sources, texts, token_ids)
    ]
    kept = _drop_overlong(items, fmt, name)
    return PromptDataset(kept, seed=seed, shuffle=shuffle, num_dropped=len(items) - len(kept), name=name)


def hold_out_groups(keys: Sequence[Any], order: Sequence[int], k: int) -> set[int]:
    """The rows held out: walking `order` (a seeded permutation of the rows), every row of the next
    row's group (rows with an equal key: the same prompt) until at least `k` rows are held. Without
    repeated keys these are exactly `order[:k]`."""
    groups: dict[Any, list[int]] = {}
    for row, key in enumerate(keys):
        groups.setdefault(key, []).append(row)
    held: set[int] = set()
    for row in order:
        if len(held) >= k:
            break
        held.update(groups[keys[row]])
    return held


def split_holdout(
    sources: list[SourcePrompt], fraction: float, seed: int
) -> tuple[list[SourcePrompt], list[SourcePrompt]]:
    """Split into (train, held-out) by a seeded permutation of the rows, whole prompts at a time: the
    rows of a prompt that appears more than once all land on one side, so the two never share a prompt."""
    if fraction <= 0:
        return sources, []
    k = max(1, round(len(sources) * fraction))
    if k >= len(sources):
        raise ValueError(
            f"eval_fraction={fraction} leaves no training prompts out of {len(sources)}; lower it"
        )
    order = np.random.default_rng(seed).permutation(len(sources)).tolist()
    held = hold_out_groups([s.text for s in sources], order, k)
    if len(held) == len(sources):
        distinct = len({s.text for s in sources})
        raise ValueError(
            f"eval_fraction={fraction} holds out every prompt: the {len(sources)} rows hold {distinct} "
            "distinct prompts, each kept whole on one side; lower eval_fraction or add prompts"
        )
    train = [s for i, s in enumerate(sources) if i not in held]
    return train, [s for i, s in enumerate(sources) if i in held]


def build_splits(
    ds: DatasetConfig, fmt: PromptFormatConfig, tokenizer: Any, *, seed: int = 0
) -> tuple[PromptDataset, PromptDataset | None]:
    """Train and eval PromptDatasets from `ds`: eval from eval_path (its eval_split), else from train_path's
    eval_split, else held out of the training rows by eval_fraction."""
    train_src = rows_to_prompts(load_rows(ds.train_path, ds.train_split), ds, source=ds.train_path)
    eval_src: list[SourcePrompt] = []
    if ds.eval_path:
        eval_src = rows_to_prompts(load_rows(ds.eval_path, ds.eval_split), ds, source=ds.eval_path)
    elif ds.eval_split is not None:
        if saved_splits(ds.train_path) is None:
            raise ValueError(
                f"eval_split={ds.eval_split!r} without eval_path reads that split of train_path, but "
                f"{ds.train_path} is not a DatasetDict saved with save_to_disk; set eval_path to the "
                "held-out prompts, or use eval_fraction instead of eval_split"
            )
        source = f"{ds.train_path} (split {ds.eval_split})"
        eval_src = rows_to_prompts(load_rows(ds.train_path, ds.eval_split), ds, source=source)
    else:
        train_src, eval_src = split_holdout(train_src, ds.eval_fraction, seed)
    train = build_prompt_dataset(train_src, tokenizer, fmt, seed=seed, shuffle=True, name="train")
    if not eval_src:
        return train, None
    return train, build_prompt_dataset(eval_src, tokenizer, fmt, seed=seed, shuffle=False, name="eval")


class PromptDataset:
    """Prompts served in a seeded per-epoch order from a resumable `PromptCursor`.

    `next_batch(n)` returns the next n prompts, crossing into the next epoch (and its new permutation) when
    one runs out. Iterating or indexing reads the prompts in their stored order and does not move the cursor.
    """

    def __init__(
        self,
        items: list[PromptItem],
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_dropped: int = 0,
        name: str = "train",
    ) -> None:
        if not items:
            raise ValueError(f"the {name} dataset is empty")
        ids = [it.prompt_id for it in items]
        if len(set(ids)) != len(ids):
            raise ValueError(f"the {name} dataset has duplicate prompt_ids; each prompt needs its own id")
        self.items = list(items)
        self.seed = seed
        self.shuffle = shuffle
        self.num_dropped = num_dropped
        self.name = name
        self._fingerprint: str | None = None
        self.run_seed: int | None = None
        self.cursor = self.new_cursor()

    def new_cursor(self, num_epochs: int | None = None) -> PromptCursor:
        """A cursor over these prompts with this dataset's seed, shuffle and fingerprint."""
        return PromptCursor(
            len(self.items),
            seed=self.seed,
            shuffle=self.shuffle,
            num_epochs=num_epochs,
            fingerprint=self.fingerprint(),
            name=self.name,
            run_seed=self.run_seed,
        )

    def order_by_run(self, run_seed: int) -> None:
        """Serve the prompts in an order that also depends on the run's seed (runs of one task with
        different seeds see the same prompts in different orders, as their sampling differs too); only
        before the first batch."""
        if self.cursor.epoch or self.cursor.position:
            raise RuntimeError(f"the {self.name} prompts were already served; set the run's order first")
        self.run_seed = int(run_seed)
        self.cursor = self.new_cursor()

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    @property
    def position(self) -> int:
        return self.cursor.position

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.items)

    def next_batch(self, n: int) -> list[PromptItem]:
        """The next `n` prompts in this epoch's order, moving on to the next epoch when needed."""
        return [self.items[i] for i in self.cursor.next_indices(n)]

    def fingerprint(self) -> str:
        """A short hash of the prompt ids and texts, to check a checkpoint belongs to this dataset."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for it in self.items:
                h.update(f"{it.prompt_id}\x00{it.prompt}\x01".encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        """The cursor, plus what identifies the dataset: save this with a checkpoint."""
        return self.cursor.state_dict()

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse a `state_dict()` of another dataset or seed (nothing changes)."""
        self.cursor.check_state_dict(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict()`; refuses one written for a different dataset or seed."""
        self.cursor.load_state_dict(state)
