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
