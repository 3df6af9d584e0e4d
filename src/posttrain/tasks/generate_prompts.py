"""The token ids `posttrain generate` gives its prompts: those the training run gave its task's prompts.

A model directory written by posttrain (a run's hf/, an export) records the run's prompt format
(models/prompt_record.py). Its fields are the defaults: the template and system prompt apply as they did
in training, and `chat_template` and `prepend_bos` hold unless --chat-template or --bos / --no-bos say
otherwise. A directory without the record (a hub model, one written by another tool or exported from a
checkpoint saved before the record existed) gets PromptFormatConfig's defaults: the tokenizer's chat
template when it has one (auto), BOS first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from posttrain.config import ConfigError, format_validation_error
from posttrain.models.prompt_record import PROMPT_FORMAT_FILE, read_prompt_format
from posttrain.tasks.datasets import PromptFormatConfig, prompt_token_ids


def generate_format(
    model_dir: str, chat_template: str | None, bos: bool | None
) -> tuple[PromptFormatConfig, Path | None]:
    """The prompt format for prompts to the model in `model_dir`, and the record it came from (None: no
    record). `chat_template` and `bos`, when not None, override the recorded or default values."""
    try:
        found = read_prompt_format(model_dir)
    except ValueError as e:
        raise ConfigError(f"{e}; fix or delete it (generate then uses the flags' defaults)") from None
    fields, path = found if found is not None else ({}, None)
    given = {"chat_template": chat_template, "prepend_bos": bos}
    try:
        fmt = PromptFormatConfig.model_validate(
            {**fields, **{k: v for k, v in given.items() if v is not None}}
        )
    except ValidationError as err:
        text = format_validation_error(PromptFormatConfig, err, heading=f"the prompt format in '{path}'")
        raise ConfigError(f"{text}\nfix or delete {PROMPT_FORMAT_FILE}") from None
    return fmt, path


def generate_prompt_ids(
    texts: list[str],
    tokenizer: Any,
    model_dir: str,
    tokenizer_name: str,
    chat_template: str | None,
    bos: bool | None,
) -> list[list[int]]:
    """The token ids of `texts` for the model in `model_dir` (see the module docstring); `tokenizer_name`
    names the tokenizer in messages. A chat template asked for that the tokenizer lacks, or a prompt with
    no tokens, is a ConfigError that says which flag fixes it."""
    fmt, path = generate_format(model_dir, chat_template, bos)
    if fmt.chat_template == "always" and not getattr(tokenizer, "chat_template", None):
        said = "--chat-template always"
        if not chat_template:
            said = f"the prompt format recorded in '{path}' (the training run's) has chat_template: always"
        raise ConfigError(
            f"{said}, but the tokenizer of '{tokenizer_name}' has no chat template; pass the tokenizer the "
            "model was trained with (--tokenizer), or --chat-template auto or never"
        )
    ids = prompt_token_ids(texts, tokenizer, fmt)
    for i, (text, row) in enumerate(zip(texts, ids)):
        if not row:
            fix = ""
            if not fmt.prepend_bos:
                fix = "drop --no-bos" if bos is False else "pass --bos"
                fix += " (the BOS token alone is a prompt), or "
            raise ConfigError(f"prompt {i + 1} ({text!r}) has no tokens: {fix}give it some text")
    return ids
