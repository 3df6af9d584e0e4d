"""The prompt format a training run gave its prompts, recorded in the Hugging Face directories posttrain
writes, so that `posttrain generate` tokenizes prompts as the run did.

The record is a JSON object, `posttrain_prompt_format.json`: the fields of the run's `PromptFormatConfig`
(tasks/datasets.py) as the run used them (template, system prompt, chat_template mode, prepend_bos and
the prompt length limits). Runs that save a model directory (SFT's, DPO's and RM's hf/) write it there;
runs that save checkpoints (GRPO, asynchronous GRPO, PPO, distillation) keep the same object in each
checkpoint's extra state under `prompt_format`, and `posttrain export` writes it into the directory it
exports. A run on a multi-turn environment records none (the environment renders its episodes), nor does
a checkpoint saved before the record existed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PROMPT_FORMAT_FILE = "posttrain_prompt_format.json"
EXTRA_STATE_KEY = "prompt_format"  # where a checkpoint's extra state holds the record


def write_prompt_format(out_dir: str | Path, fields: Mapping[str, Any] | None) -> None:
    """Write the record `fields` into the model directory `out_dir`; nothing when `fields` is None."""
    if fields is None:
        return
    text = json.dumps(dict(fields), indent=2, sort_keys=True) + "\n"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / PROMPT_FORMAT_FILE).write_text(text, encoding="utf-8")


def read_prompt_format(model_dir: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The record in `model_dir` and its path; None when the directory has none (or `model_dir` is not a
    local directory). A file that is not a JSON object is a ValueError that names it."""
    path = Path(model_dir).expanduser() / PROMPT_FORMAT_FILE
    if not path.is_file():
        return None
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read the prompt format recorded in '{path}': {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(
            f"the prompt format recorded in '{path}' is not a JSON object (got {type(fields).__name__})"
        )
    return fields, path
