"""Saved tokenizers load back as themselves: `AutoTokenizer.from_pretrained` (and posttrain's
`load_tokenizer`) on a checkpoint's hf/ directory, a `posttrain export` and a `save_hf` directory gives
the tokenizer that trained, for the built-in tokenizers and an HF one, next to Llama and Qwen2 configs
(transformers rebuilds any Qwen2 model's tokenizer as a byte-level Qwen2Tokenizer unless told otherwise:
"a b" came back as "ab")."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from helpers import policy_cfg
from posttrain.checkpoint import HF_FILES_DIR
from posttrain.models.hf import load_tokenizer, save_hf
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.policy.export import export_hf
from posttrain.policy.worker import PolicyWorker

TEXT = "12+30=42\nThe answer is  7.\n\tTabs, (parens) and: colons\n\nünïcödé ß 你好 🙂 end"


def _hf_tokenizer(path: Path) -> str:
    """A small BPE tokenizer trained here (Metaspace pre-tokenizer, byte fallback off, an unk token)."""
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    corpus = [TEXT, "the quick brown fox jumps over the lazy dog\n", "1 2 3 4 5 6 7 8 9 0 + - = ( )"] * 5
    tk.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.save_pretrained(path)
    return str(path)


def _same(loaded, trained) -> None:
    ids = trained(TEXT)["input_ids"]
    assert loaded(TEXT)["input_ids"] == ids, type(loaded).__name__
    assert loaded.decode(ids) == trained.decode(ids)
    assert loaded.get_vocab() == trained.get_vocab()
    assert loaded.chat_template == trained.chat_template
    assert (loaded.eos_token, loaded.pad_token) == (trained.eos_token, trained.pad_token)


@pytest.mark.parametrize("tokenizer", ["tiny", "tiny-chat", "hf"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_checkpoint_export_and_save_hf_give_back_the_trained_tokenizer(family, tokenizer, tmp_path):
    name = _hf_tokenizer(tmp_path / "tok") if tokenizer == "hf" else tokenizer
    cfg = policy_cfg(
        model={"tiny": {"family": family, "hidden_size": 32, "intermediate_size": 64}, "tokenizer": name}
    )
    worker = PolicyWorker(cfg)
    worker.save_checkpoint(str(tmp_path / "ckpt"))
    export_hf(tmp_path / "ckpt", tmp_path / "export")
    save_hf(worker.model, worker.tokenizer, tmp_path / "hf")
    for d in (tmp_path / "ckpt" / HF_FILES_DIR, tmp_path / "export", tmp_path / "hf"):
        _same(AutoTokenizer.from_pretrained(d), worker.tokenizer)
        _same(AutoTokenizer.from_pretrained(d, trust_remote_code=True), worker.tokenizer)
        _same(load_tokenizer(str(d)), worker.tokenizer)
    assert "a b\nc" in worker.tokenizer.decode(worker.tokenizer("a b\nc")["input_ids"]) or tokenizer == "hf"


def test_plain_save_pretrained_next_to_a_qwen2_config_loses_spaces(tmp_path):
    """The transformers behaviour this works around (if it ever changes, the pin is no longer needed)."""
    from posttrain.models.hf import build_tiny_model

    tok = build_char_tokenizer()
    build_tiny_model(len(tok), family="qwen2").config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.decode(loaded("a b\nc")["input_ids"]) == "abc"
