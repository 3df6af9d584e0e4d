"""A small character-level tokenizer built locally (no hub), for the built-in tasks and tests.

It is a real `PreTrainedTokenizerFast`: `save_pretrained` writes tokenizer.json and
`AutoTokenizer.from_pretrained(dir)` loads it back.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
DEFAULT_CHARS = string.digits + "+-*/=?()., :" + string.ascii_lowercase + string.ascii_uppercase + "\n"


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """One token per character of `chars`, plus <pad>=0, <s>=1, </s>=2, <unk>=3."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def pad_token_id(tokenizer) -> int:
    """The id that right-pads training rows (the trainer and the rollout workers must agree)."""
    return tokenizer.pad_token_id or 0


# ChatML with tools, compact enough for a character-level tokenizer: the tool list is one line of
# signatures (a real model's template prints the JSON schemas), calls are Hermes-style JSON.
CHAT_TEMPLATE = (
    "{%- if tools or messages[0].role == 'system' %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% if tools %}\n{% endif %}{% endif %}"
    "{%- if tools %}tools:{% for t in tools %} {{ t.function.name }}("
    "{{ t.function.parameters.properties | list | join(',') }}){% endfor %}{% endif %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{% if not loop.first %}<|im_start|>system\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
CHAT_CHARS = DEFAULT_CHARS + "<>{}[]\"_|#!%&;'`\\^~$@"


def build_chat_tokenizer(chars: str = CHAT_CHARS) -> PreTrainedTokenizerFast:
    """The character tokenizer with chat tokens (`<|im_start|>`, `<|im_end|>`, tool-call and
    tool-response markers, one id each) and a ChatML chat template that renders `tools=`: the
    tokenizer of the built-in multi-turn environments (model name `tiny-chat`)."""
    tok = build_char_tokenizer(chars)
    tok.add_special_tokens({"additional_special_tokens": CHAT_SPECIAL_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    return tok
