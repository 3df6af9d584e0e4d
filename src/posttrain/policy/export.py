"""Export of a checkpoint for use outside posttrain (`posttrain export`): a Hugging Face model directory,
or, for a LoRA checkpoint, the merged model or a peft adapter directory.

Runs on one process without a process group, whatever the number of ranks that saved the checkpoint,
and writes atomically (into a temporary sibling renamed into place once complete). The model is a causal
LM, or for a scalar-head checkpoint (reward model, critic: `model.head=score` in its identity,
policy/identity.py) transformers' sequence-classification model. A full checkpoint holds every weight
and is consolidated from its shards, with the generation config it was saved with. A LoRA checkpoint
holds the adapters alone (`TrainState.trainable_only`; a scalar head's trained score head with them), so
its merged export rebuilds the base model from the identity the checkpoint was saved with
(`model.name`, or the `base` given instead; for `tiny`, the random model of `model.tiny` and
`model.seed`; a local path is recorded absolute since policy/model_paths.py, relative to the training
run's working directory before it), checks it against the checkpoint's fingerprint, loads the adapters
into it and merges them as `Policy.full_state_dict` does (base + scaling * B @ A in fp32). The adapter export needs no base model: the checkpoint's adapter
tensors go out under peft's names next to an `adapter_config.json` (`all-linear` written as the layers
it adapted; for a scalar head, task SEQ_CLS with the score head in `modules_to_save`), so
`peft.PeftModel.from_pretrained(base, out_dir)` loads them. Every export also holds the prompt format
record of the run that saved the checkpoint (models/prompt_record.py), when its extra state has one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
)

from posttrain import checkpoint
from posttrain.checkpoint_verify import read_json
from posttrain.dtypes import DTYPES
from posttrain.logging import get_logger
from posttrain.models.hf import looks_like_path
from posttrain.models.lora import (
    ALL_LINEAR,
    LoraSettings,
    is_adapter_key,
    peft_state_dict,
    target_names,
    unload_merged,
)
from posttrain.models.prompt_record import EXTRA_STATE_KEY, write_prompt_format
from posttrain.models.scalar_head import SCORE_HEAD
from posttrain.policy.config import ModelConfig
from posttrain.policy.identity import BASE, base_weights, other_base, saved_head
from posttrain.policy.model_init import build_tokenizer, load_full_model, with_lora
from posttrain.policy.model_paths import BUILT_IN, absolute_local_path

log = get_logger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the file name PeftModel.from_pretrained reads


def export_hf(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dtype: str | None = None,
    adapter: bool = False,
    base: str | None = None,
) -> Path:
    """Write a checkpoint's model to `out_dir` as a Hugging Face directory (safetensors, config,
    generation config, tokenizer) that `AutoModelForCausalLM.from_pretrained(out_dir)` loads
    (`AutoModelForSequenceClassification` for a scalar head); a LoRA checkpoint's adapters are merged
    into its base (`base`, a directory or hub name, instead of the `model.name` the checkpoint records).
    With `adapter`, a LoRA checkpoint's peft adapter directory instead.
    Weights stay fp32 unless `dtype` ("float32", "bfloat16" or "float16") says otherwise."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {sorted(DTYPES)}")
    root = Path(checkpoint_dir).absolute()
    meta = checkpoint.read_metadata(root)
    lora = meta["fingerprint"]["config"].get("lora")
    if adapter and lora is None:
        raise ValueError(
            f"checkpoint '{root}' is a full fine-tuning checkpoint: it has no LoRA adapters to export. "
            "Drop --adapter to export its weights as a Hugging Face directory"
        )
    if base is not None and lora is None:
        raise ValueError(
            f"checkpoint '{root}' is a full fine-tuning checkpoint: it holds every weight and has no base "
            "model to merge into. Drop --base"
        )
    cast = DTYPES[dtype] if dtype else None
    with export_dir(out_dir) as tmp:
        if lora is None:
            _consolidated_model(root, meta, cast).save_pretrained(tmp, safe_serialization=True)
        elif adapter:
            _write_adapter(root, meta, tmp, cast, base)
        else:
            _write_merged(root, meta, tmp, cast, base)
        copy_tokenizer_files(root, tmp)
        write_prompt_format(tmp, recorded_prompt_format(root))
    out = Path(out_dir).absolute()
    log.info("exported %s to %s%s", root, out, " (peft adapter)" if adapter else "")
    return out


@contextmanager
def export_dir(out_dir: str | Path) -> Iterator[Path]:
    """A temporary directory next to `out_dir` to write an export into, renamed to `out_dir` when the
    block succeeds and removed when it fails (nothing half-written is ever at `out_dir`). A non-empty
    `out_dir` is refused before anything is written."""
    out = Path(out_dir).absolute()
    if out.exists() and any(out.iterdir()):
        raise ValueError(
            f"export directory '{out}' exists and is not empty; pass a new directory or delete it"
        )
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_tokenizer_files(checkpoint_dir: str | Path, out_dir: Path) -> None:
    """The tokenizer files saved with a checkpoint, copied into an export directory."""
    for f in (Path(checkpoint_dir) / checkpoint.HF_FILES_DIR).iterdir():
        if f.is_file() and f.name not in ("config.json", "generation_config.json"):
            shutil.copy2(f, out_dir / f.name)


def recorded_prompt_format(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """The prompt format record a training loop kept in the checkpoint's extra state (None: a checkpoint
    saved before the record existed, by a run on an environment, or by a companion)."""
    path = Path(checkpoint_dir) / checkpoint.EXTRA_STATE_FILE
    extra = read_json(path) if path.is_file() else None
    return extra.get(EXTRA_STATE_KEY) if isinstance(extra, dict) else None


def _auto_class(meta: dict[str, Any]):
    """The transformers class of a checkpoint's model: a causal LM, or a sequence classifier for a scalar
    head."""
    return AutoModelForSequenceClassification if saved_head(meta) == "score" else AutoModelForCausalLM


def how_to_load(checkpoint_dir: str | Path, adapter: bool = False) -> str:
    """The call that loads a checkpoint's export (`adapter`: its peft adapter directory)."""
    name = _auto_class(checkpoint.read_metadata(Path(checkpoint_dir).absolute())).__name__
    if adapter:
        return f"peft.PeftModel.from_pretrained({name}.from_pretrained(base), out)"
    return f"{name}.from_pretrained"


def _consolidated_model(root: Path, meta: dict[str, Any], dtype: torch.dtype | None):
    """A full checkpoint's model, built from its saved config and filled from its shards, with its saved
    generation config (a checkpoint saved without one: derived from the model config)."""
    hf_dir = root / checkpoint.HF_FILES_DIR
    model = _auto_class(meta).from_config(AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
    tied = set(checkpoint.tied_aliases(model))
    missing, unexpected = model.load_state_dict(checkpoint.read_model_tensors(root), strict=False)
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"checkpoint '{root}' does not fit its own model config: missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}. The checkpoint is damaged or was edited"
        )
    if (hf_dir / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(hf_dir)
    return model.to(dtype) if dtype is not None else model


# ---------------------------------------------------------------------- LoRA checkpoints


def _base_config(meta: dict[str, Any], base: str | None, root: Path) -> ModelConfig:
    """The model section a LoRA checkpoint's base is rebuilt from (`base`: the model to use instead of
    the recorded `model.name`). A recorded tokenizer that is not a local directory from here (a path
    relative to the training run's working directory, or a hub name) is read from the tokenizer files
    the checkpoint `root` saved: the ones the run trained with, found without the run's directory or
    the hub."""
    identity = meta["fingerprint"]["config"]
    tokenizer = identity["model.tokenizer"]
    saved = root / checkpoint.HF_FILES_DIR
    elsewhere = (
        tokenizer is not None and tokenizer not in BUILT_IN and not Path(tokenizer).expanduser().is_dir()
    )
    if elsewhere and (saved / "tokenizer_config.json").is_file():
        log.warning(
            "checkpoint '%s' records model.tokenizer=%r, not a directory from here; using the tokenizer "
            "files the checkpoint saved",
            root,
            tokenizer,
        )
        tokenizer = str(saved)
    fields = {
        "name": absolute_local_path(base) or identity["model.name"],
        "tokenizer": tokenizer,
        "head": saved_head(meta),
    }
    if fields["name"] == "tiny":
        fields |= {"tiny": identity["model.tiny"], "seed": identity["model.seed"]}
    return ModelConfig.model_validate(fields)


def _relative(name: str | None) -> bool:
    """A recorded model or tokenizer name that is relative to the training run's working directory if it
    is a local path (not a built-in name, not absolute; it may also be a hub name)."""
    return name is not None and name not in BUILT_IN and not Path(name).expanduser().is_absolute()


def _relative_path(name: str | None) -> bool:
    """A recorded name that is a relative local path: relative, and a path here or shaped like one."""
    return _relative(name) and (Path(name).expanduser().exists() or looks_like_path(name))


def _recorded(identity: dict[str, Any]) -> str:
    """The base and tokenizer a checkpoint records, as its training config gave them."""
    shown = [f"{key}={identity[key]!r}" for key in ("model.name", "model.tokenizer") if identity[key]]
    return " and ".join(shown)


def _load_base(root: Path, meta: dict[str, Any], base: str | None):
    """A LoRA checkpoint's base model with its (untrained) adapters, and its model config. A base that
    cannot be loaded is a ValueError that names what the checkpoint records and how to fix it."""
    identity = meta["fingerprint"]["config"]
    model_cfg = _base_config(meta, base, root)
    used = [identity["model.name"] if base is None else None, identity["model.tokenizer"]]
    if any(_relative(n) and Path(n).expanduser().exists() for n in used):
        log.warning(
            "checkpoint '%s' records %s, relative to its training run's working directory; loading it from "
            "this directory (%s). If the run was started elsewhere, export from there or pass --base",
            root,
            _recorded(identity),
            Path.cwd(),
        )
    try:
        model = load_full_model(model_cfg, build_tokenizer(model_cfg))
    except (ValueError, OSError) as e:
        where = ""
        if any(_relative(n) for n in used):
            where = (
                " (a local path there is relative to the directory the training run was started in, "
                f"not to this one, {Path.cwd()})"
            )
        raise ValueError(
            f"could not load the base model of LoRA checkpoint '{root}': its training config recorded "
            f"{_recorded(identity)}{where}. Run `posttrain export` from the training run's directory, or "
            f"pass the base model with --base DIR_OR_HUB_NAME. The error was: {e}"
        ) from None
    if BASE in identity and other_base(
        identity, now := base_weights(model_cfg)
    ):  # no record: nothing to hash
        raise ValueError(
            f"the base model in model.name={model_cfg.name!r} is not the one the adapters of '{root}' were "
            f"trained on: its weights were replaced (checkpoint {identity[BASE]}, now {now}). Put the "
            "original base model back there (or pass it with --base), or export the adapters alone (--adapter)"
        )
    return with_lora(model, LoraSettings(**identity["lora"]), model_cfg.head), model_cfg


def _trained(root: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors a LoRA checkpoint trained (the adapters, and a scalar head's score head), checked
    against the names and shapes its fingerprint lists."""
    tensors = checkpoint.read_model_tensors(root)
    head = saved_head(meta) == "score"
    listed = {
        n: shape
        for n, shape in meta["fingerprint"]["model"]["params"].items()
        if is_adapter_key(n) or (head and n.split(".", 1)[0] == SCORE_HEAD)
    }
    found = {n: list(t.shape) for n, t in tensors.items()}
    if found != listed or not any(is_adapter_key(n) for n in listed):
        raise ValueError(
            f"checkpoint '{root}' does not hold the adapters its metadata lists (missing "
            f"{sorted(set(listed) - set(found))[:5]}, unexpected {sorted(set(found) - set(listed))[:5]}). "
            "The checkpoint is damaged or was edited"
        )
    return tensors


def _write_merged(
    root: Path, meta: dict[str, Any], out: Path, dtype: torch.dtype | None, base: str | None
) -> None:
    identity = meta["fingerprint"]["config"]
    model, model_cfg = _load_base(root, meta, base)
    try:
        fingerprint = {"model": checkpoint.model_fingerprint(model), "config": identity}
        checkpoint.check_compatible(meta, fingerprint, root)
    except ValueError as e:
        raise ValueError(
            f"the base model rebuilt from model.name={model_cfg.name!r} is not the one the adapters of "
            f"'{root}' were trained on: {e}"
        ) from None
    model.load_state_dict(_trained(root, meta), strict=False)  # the base's own weights stay
    model = unload_merged(model)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)


def _write_adapter(
    root: Path, meta: dict[str, Any], out: Path, dtype: torch.dtype | None, base: str | None
) -> None:
    identity = meta["fingerprint"]["config"]
    trained = _trained(root, meta)
    config = LoraSettings(**identity["lora"]).peft_config()
    if config.target_modules == ALL_LINEAR:  # peft would resolve it again, onto MoE experts and routers
        params = meta["fingerprint"]["model"]["params"]
        adapted = {n.partition(".lora_A.")[0] for n in trained if ".lora_A." in n}
        config.target_modules = target_names(adapted, _module_names(params))
    config.base_model_name_or_path = absolute_local_path(base) or identity["model.name"]
    if base is None and _relative_path(identity["model.name"]):
        log.warning(
            "adapter_config.json names the base model as checkpoint '%s' records it, model.name=%r: a local "
            "path there is relative to the training run's working directory. Pass --base to write another",
            root,
            identity["model.name"],
        )
    saved = ()
    if saved_head(meta) == "score":
        config.task_type, config.modules_to_save = "SEQ_CLS", [SCORE_HEAD]
        saved = (SCORE_HEAD,)
    else:
        config.task_type = "CAUSAL_LM"
    config.save_pretrained(out)
    tensors = peft_state_dict(trained.items(), modules_to_save=saved)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})


def _module_names(params: dict[str, Any]) -> set[str]:
    """Every module path of a model, from its parameter names."""
    out = set()
    for name in params:
        parts = name.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts))}
    return out
