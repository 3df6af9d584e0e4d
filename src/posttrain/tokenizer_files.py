"""Writing a tokenizer next to a model config so that `AutoTokenizer.from_pretrained(dir)` gives it back.

`save_pretrained` alone is not enough: for some model types (Qwen2, Phi-3 and others that transformers
lists as having wrong hub tokenizer classes) AutoTokenizer ignores the saved `tokenizer_class` and
rebuilds the model type's own class (Qwen2Tokenizer: byte-level BPE) from the vocabulary, dropping the
saved pre-tokenizer and decoder. A character-level or WordLevel tokenizer then loses every space and
newline ("a b" -> "ab"). After saving, the directory is loaded back through AutoTokenizer and compared
with the tokenizer that trained; when they differ, `tokenizer_config.json` gets an `auto_map` that
names a plain `PreTrainedTokenizerFast` subclass shipped in the directory. AutoTokenizer then loads
`tokenizer.json` as it is: the model type's class is skipped, and the directory's class is used with
`trust_remote_code=True` and the equivalent built-in class without it (transformers 5.17 to 5.24).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.logging import get_logger

log = get_logger(__name__)

MODULE = "tokenization_posttrain"
CLASS = "PosttrainTokenizer"
MODULE_SOURCE = f'''"""Written by posttrain: loads tokenizer.json as it is (see tokenizer_config.json's auto_map)."""

from transformers import PreTrainedTokenizerFast


class {CLASS}(PreTrainedTokenizerFast):
    """The tokenizer of tokenizer.json, pre-tokenizer and decoder included."""
'''
PROBE = "Hello  world!\n\tline two: a b  c\n\nunicode: é ß 你好 🙂 <s></s>"


def save_tokenizer(tokenizer: Any, out_dir: str | Path) -> None:
    """`tokenizer.save_pretrained(out_dir)`, made to load back as itself through AutoTokenizer when
    `out_dir` holds a model config (see the module docstring); warns when it still does not."""
    out = Path(out_dir)
    tokenizer.save_pretrained(out)
    if not (out / "config.json").exists():
        return
    problem = reload_problem(tokenizer, out)
    if problem is None:
        return
    _pin_class(out)
    still = reload_problem(tokenizer, out)
    if still is not None:
        log.warning(
            "AutoTokenizer.from_pretrained(%s) does not give back the trained tokenizer: %s", out, still
        )


def reload_problem(tokenizer: Any, directory: str | Path) -> str | None:
    """How `AutoTokenizer.from_pretrained(directory)` differs from `tokenizer` (vocabulary, special
    tokens, encoding and decoding of text with spaces, newlines and unicode); None when it does not."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(directory))
    if loaded.get_vocab() != tokenizer.get_vocab():
        return "the vocabulary differs"
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(loaded, name) != getattr(tokenizer, name):
            return f"{name} is {getattr(loaded, name)!r}, not {getattr(tokenizer, name)!r}"
    ids, got = tokenizer(PROBE)["input_ids"], loaded(PROBE)["input_ids"]
    if got != ids:
        return f"{PROBE!r} encodes to {got[:12]}..., not {ids[:12]}... ({type(loaded).__name__})"
    if loaded.decode(ids) != tokenizer.decode(ids):
        return f"decoding gives {loaded.decode(ids)!r}, not {tokenizer.decode(ids)!r}"
    if getattr(loaded, "chat_template", None) != getattr(tokenizer, "chat_template", None):
        return "the chat template differs"
    return None


def _pin_class(out: Path) -> None:
    """Point AutoTokenizer at a plain fast-tokenizer class shipped in `out` (see the module docstring)."""
    (out / f"{MODULE}.py").write_text(MODULE_SOURCE)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, f"{MODULE}.{CLASS}"]}
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
