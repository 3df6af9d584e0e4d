"""Scalar-head models: a decoder with a linear head that gives one number per token (reward models, critics).

The model is transformers' `AutoModelForSequenceClassification` with `num_labels=1`: its `score` head (a
Linear hidden -> 1) reads the decoder's last hidden states. It loads from a sequence-classification
checkpoint, or from a causal LM (an SFT run's hf/ directory) whose lm_head is dropped and whose score head
starts new (seeded). HF's forward pools the head's output at the last token that is not the pad id; we
read the head's per-token output instead (forward hooks put it in the model's output) and take a row's score at
`input_lengths - 1`, so padding and packing follow our batch's conventions (a pad id inside a sequence
moves nothing) and the same forward gives a PPO critic its value per token.

Output convention of `microbatch_values`: [b, t] aligned with the micro-batch's `input_ids`; position i
holds the head's output after reading tokens <= i; padding holds 0. `model_outputs` is what the trainer
hands a loss per micro-batch: logprobs for `head=lm`, these values for `head=score`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForSequenceClassification, PretrainedConfig
from transformers.utils import logging as hf_logging

from posttrain.data.microbatch import MicroBatch
from posttrain.logging import get_logger
from posttrain.models.families import attn_implementation
from posttrain.models.hf import TinyModelConfig, hf_source, load_hf_config, tiny_config
from posttrain.models.logprobs import (
    SequenceSplit,
    _split_call,
    _unpack,
    microbatch_logprobs,
    model_logits,
    supports_shared_prefix,
)

Head = Literal["lm", "score"]
SCORE_HEAD = "score"  # the module name of transformers' sequence-classification head

log = get_logger(__name__)


def score_model_config(config: PretrainedConfig, pad_id: int) -> PretrainedConfig:
    """`config` as a one-output scorer: num_labels=1, and a pad id (HF's own pooling, which a saved model
    runs when loaded elsewhere, refuses batches without one)."""
    config.num_labels = 1
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = pad_id
    return config


def warn_if_pad_is_eos(tokenizer: Any, what: str) -> bool:
    """Warn (and return True) when `tokenizer` pads with its EOS: posttrain reads a reward at each row's
    last real token, the completion's EOS, while transformers' sequence classifier (what a saved reward
    model runs elsewhere, and what TRL trains) pools at the last token that is not the pad id, the one
    before that EOS; the two then score different positions."""
    pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if pad is None or pad != eos:
        return False
    log.warning(
        "%s: the tokenizer pads with its EOS (id %d). posttrain reads the reward at the EOS that ends each "
        "completion; transformers' AutoModelForSequenceClassification (a saved model used elsewhere, or "
        "one trained by TRL) pools at the token before it, so scores differ between the two. Give the "
        "tokenizer a pad token of its own (e.g. add '<|pad|>' and save it) to make them agree",
        what,
        pad,
    )
    return True


def check_score_source(config: PretrainedConfig, name: str) -> None:
    """Refuse, before weights load, a checkpoint that cannot start a scalar-head model: one that is neither
    a causal LM nor a sequence-classification model, a sequence-classification model with more than one
    output, or a model type transformers has no sequence-classification class for."""
    archs = list(getattr(config, "architectures", None) or [])
    fix = (
        "A reward model (model.head=score) starts from a causal LM (its score head new; e.g. an SFT run's "
        "hf/ directory) or from a sequence-classification model with num_labels=1"
    )
    if any(a.endswith("ForSequenceClassification") for a in archs):
        if config.num_labels != 1:
            raise ValueError(
                f"model '{name}' is a sequence-classification model with num_labels={config.num_labels}; a "
                f"reward model has one output. {fix}: start from its base causal LM instead"
            )
    elif not any(a.endswith("ForCausalLM") for a in archs):
        what = ", ".join(archs) if archs else "a model of unknown architecture (config.json names none)"
        raise ValueError(f"model '{name}' is {what}, neither a causal LM nor a sequence classifier. {fix}")
    if type(config) not in AutoModelForSequenceClassification._model_mapping:
        raise ValueError(
            f"model '{name}': transformers has no sequence-classification class for model type "
            f"'{config.model_type}', so it cannot carry a score head. {fix}"
        )


def build_tiny_score_model(vocab_size: int, pad_id: int, seed: int = 0, cfg: TinyModelConfig | None = None):
    """A randomly initialised tiny scalar-head model in fp32 (deterministic for a seed)."""
    config = score_model_config(tiny_config(vocab_size, cfg), pad_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForSequenceClassification.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation(config)
        )


def load_score_model(name: str, pad_id: int, seed: int = 0):
    """A scalar-head model from a local directory or hub name (checked by `check_score_source`), fp32;
    a new score head (from a causal LM) is initialised from `seed`."""
    config = load_hf_config(name)
    check_score_source(config, name)
    source, kwargs = hf_source(name)
    from_lm = not any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    quiet = _quiet_transformers() if from_lm else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), quiet:
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            source,
            config=score_model_config(config, pad_id),
            dtype=torch.float32,
            attn_implementation=attn_implementation(config),
            **kwargs,
        )
    if from_lm:  # transformers' load report would list lm_head as unexpected and score as missing
        log.info(
            "scalar head on causal LM '%s': its lm_head is dropped, the score head is new (seed %d)",
            name,
            seed,
        )
    return model


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' logging at error level during the block."""
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


@contextlib.contextmanager
def _per_token_logits(model):
    """During the block, the model's output `logits` are its score head's per-token output [b, t, 1]
    (this rank's full tensor), not HF's pooled ones. The swap happens in a forward hook on the model that
    runs before FSDP2's: FSDP2 unshards a module's parameters for backward from hooks on that module's
    outputs, so the tensor the loss reads must be one of them (a tensor taken from inside the forward
    reached the score head's parameters after they were resharded)."""
    got: list[torch.Tensor] = []

    def keep(module, inputs, output):
        got.append(output.full_tensor() if isinstance(output, DTensor) else output)

    def swap(module, inputs, output):
        output.logits = got.pop()
        return output

    handles = [model.score.register_forward_hook(keep), model.register_forward_hook(swap, prepend=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def microbatch_values(model, mb: MicroBatch, split: SequenceSplit | None = None) -> torch.Tensor:
    """The score head's output [b, t] at every token of a micro-batch, padded or packed (see the module
    docstring for the convention). Under sequence parallelism the row is padded to the layout's multiple
    and the head reads the whole row (parallel/tensor_parallel.py)."""
    ids = mb.data["input_ids"]
    t = ids.shape[1]
    with _per_token_logits(model):
        if split is not None and split.active:
            assert split.cp_mesh is None, "context parallelism is refused for scalar heads (policy/config.py)"
            values = _split_call(model, mb, split)[0][..., 0]  # [b or 1, L]
        else:
            values = model_logits(model, mb)[..., 0]
    values = _unpack(mb, values[0], t) if mb.packed is not None else values[:, :t]
    valid = torch.arange(t, device=ids.device)[None, :] < mb.data["input_lengths"][:, None]
    return values * valid


def last_token_values(values: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """[b] the value at each row's last real token (position input_lengths - 1) of [b, t] values."""
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, (input_lengths.to(values.device) - 1).clamp(min=0)]


def action_values(values: torch.Tensor) -> torch.Tensor:
    """A critic's [b, t] values aligned with logprobs: position i holds the value of the state token i was
    sampled from, the head's output after reading tokens < i (values shifted right by one; position 0,
    never trained, holds 0)."""
    return torch.nn.functional.pad(values[:, :-1], (1, 0))


def model_outputs(
    model, mb: MicroBatch, head: Head, temperature: float = 1.0, split: SequenceSplit | None = None
) -> torch.Tensor:
    """What the trainer hands a loss per micro-batch: per-token logprobs [b, t] of a causal LM
    (`head=lm`), or per-token values [b, t] of a scalar head (`head=score`)."""
    if head == "score":
        return microbatch_values(model, mb, split)
    return microbatch_logprobs(model, mb, temperature, split)


def shares_prefix(model, head: Head) -> bool:
    """Whether micro-batches may run shared-prefix plans: logprob plans of a causal LM only."""
    return head == "lm" and supports_shared_prefix(model)
