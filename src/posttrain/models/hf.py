"""Loading and saving Hugging Face causal LMs and tokenizers, and a tiny-model factory for tests and demos."""

from __future__ import annotations

import functools
import inspect
import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from posttrain.checkpoint_verify import METADATA_FILE
from posttrain.config import Config
from posttrain.logging import get_logger
from posttrain.models.families import attn_implementation
from posttrain.tokenizer_files import save_tokenizer

log = get_logger(__name__)

TinyFamily = Literal["llama", "qwen2", "qwen3", "mistral", "gemma", "qwen3_moe"]


class TinyModelConfig(Config):
    """Shape of a randomly initialised tiny model (used when `model.name` is `tiny`)."""

    family: TinyFamily = "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    sliding_window: int | None = Field(
        None, ge=1, description="attention window in tokens (Mistral/Qwen2-style models); None: full"
    )
    num_experts: int = Field(8, ge=2, description="qwen3_moe: experts per MoE layer")
    num_experts_per_tok: int = Field(2, ge=1, description="qwen3_moe: experts each token is routed to")
    moe_intermediate_size: int = Field(
        64,
        ge=1,
        description="qwen3_moe: each expert's hidden size (active MLP size: this x experts per token)",
    )


def tiny_config(vocab_size: int, cfg: TinyModelConfig | None = None, **overrides) -> PretrainedConfig:
    """A transformers config for a tiny Llama or Qwen2 model."""
    cfg = cfg or TinyModelConfig(**overrides)
    return AutoConfig.for_model(
        cfg.family,
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **({"sliding_window": cfg.sliding_window} if cfg.sliding_window is not None else {}),
        **_family_shape(cfg),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _family_shape(cfg: TinyModelConfig) -> dict:
    """Family-specific shape keys of Qwen3-MoE: its experts (every layer sparse) and a head size that
    follows the hidden size (transformers' default is 128)."""
    out: dict = {}
    if cfg.family == "qwen3_moe":
        out |= {
            "head_dim": cfg.hidden_size // cfg.num_attention_heads,
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        }
    return out


def build_tiny_model(vocab_size: int, seed: int = 0, cfg: TinyModelConfig | None = None, **overrides):
    """A randomly initialised tiny causal LM in fp32 (deterministic for a seed)."""
    config = tiny_config(vocab_size, cfg, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation(config)
        )
    return model


def tie_lm_head(model) -> None:
    """Point the lm_head at the input embedding when the config ties them (after anything replaced
    either parameter: sharding, `to_empty`). A model without an lm_head (a score head) has nothing to tie."""
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.weight = model.get_input_embeddings().weight


HUB_TIMEOUT_S = 10.0  # one request asks the hub whether a model exists (no retries)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@functools.cache
def _cache_kwarg(forward_owner: type) -> str:
    params = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(module: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword that hands `cache` (an object with the HF `Cache.update` protocol) to `module`'s
    forward: `cache` in newer transformers, `past_key_values` before it (which newer versions accept
    with a FutureWarning in every forward)."""
    return {_cache_kwarg(type(module)): cache}


def looks_like_path(name: str) -> bool:
    """A name no hub id can be ('org/name' or 'name'): absolute, relative with a dot, or deeper."""
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1 or name.endswith("/")


@functools.cache
def _hub_problem(name: str) -> str | None:
    """Why the hub cannot give `name` (one request, a short timeout, no retries); None when it can,
    or when from_pretrained will say why better (a gated model, another HTTP answer)."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        huggingface_hub.model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return None
    except RepositoryNotFoundError:
        return "there is no such model on the Hugging Face hub (if it is private: `hf auth login`)"
    except HfHubHTTPError:
        return None
    except ValueError as e:  # not a valid repo id
        return f"it is not a hub name either ({e})"
    except Exception as e:  # no network, DNS, proxy, timeout
        return (
            f"the Hugging Face hub cannot be reached from this machine ({type(e).__name__}: {e}). Download "
            f"it where the hub is reachable (`hf download {name}`) and set HF_HUB_OFFLINE=1, or pass a "
            "local directory"
        )
    return None


def _in_hub_cache(name: str) -> bool:
    import huggingface_hub

    return isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str)


def hf_source(name: str) -> tuple[str, dict[str, Any]]:
    """Check that `name` is an existing local directory or a hub model this machine can get; return what
    to pass to `from_pretrained` (the directory with `~` expanded, or the hub name) and its extra
    arguments (local_files_only when the hub is unreachable but the model is cached). Otherwise a
    ValueError names the path and the fix: a missing local path is reported as one (not as a bad hub
    id), and an unreachable hub fails after one short request, not after retries."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"model path '{name}' is a file; pass the directory holding config.json")
        if (path / METADATA_FILE).is_file() and not (path / "config.json").is_file():  # checkpoints have none
            raise ValueError(
                f"'{name}' is a posttrain checkpoint directory, not a Hugging Face model directory. Export "
                f"it first (`posttrain export {name} OUT_DIR`) and pass OUT_DIR"
            )
        return str(path), {}
    if looks_like_path(name):
        where = "" if str(path.absolute()) == name else f" ({path.absolute()})"
        raise ValueError(
            f"model path '{name}' does not exist{where}. Pass an existing directory with "
            "config.json and the weights (an SFT run's hf/ directory, a `posttrain export` output), or "
            "a hub name such as 'Qwen/Qwen2.5-0.5B'"
        )
    import huggingface_hub

    offline = huggingface_hub.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
    cached = _in_hub_cache(name)
    if offline and not cached:
        raise ValueError(
            f"'{name}' is not a local directory ({path.absolute()} does not exist), and with HF_HUB_OFFLINE "
            "set it must be in the Hugging Face cache: it is not in the cache. Download it first "
            f"(`hf download {name}` with the hub reachable) or pass a local directory"
        )
    problem = None if offline else _hub_problem(name)
    if problem is None:
        return name, {"local_files_only": True} if offline else {}
    if cached:
        log.warning("the hub is unreachable (%s); loading '%s' from the local cache", problem, name)
        return name, {"local_files_only": True}
    raise ValueError(f"'{name}' is not a local directory ({path.absolute()} does not exist) and {problem}")


def load_hf_config(name_or_path: str) -> PretrainedConfig:
    """The transformers config of a local directory or hub name (checked as `hf_source` does; a peft
    adapter directory is refused with the way to a model)."""
    source, kwargs = hf_source(name_or_path)
    _refuse_adapter_dir(Path(source), name_or_path)
    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except OSError as e:
        raise ValueError(f"could not load the config of model '{name_or_path}': {e}") from e


def _refuse_adapter_dir(path: Path, name: str) -> None:
    """A peft adapter directory (adapter_config.json without config.json) holds adapters, not a model:
    refused with the two ways to a model."""
    if not (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        return
    adapter = json.loads((path / "adapter_config.json").read_text())
    auto = (
        "AutoModelForSequenceClassification"
        if adapter.get("task_type") == "SEQ_CLS"
        else "AutoModelForCausalLM"
    )
    raise ValueError(
        f"'{name}' is a peft adapter directory (adapter_config.json, no config.json): it holds LoRA "
        "adapters, not a model. Export the checkpoint without --adapter (`posttrain export CHECKPOINT "
        "OUT_DIR`) for the adapters merged into the base model, or load it with peft on its base "
        f"({adapter.get('base_model_name_or_path')!r}): "
        f"peft.PeftModel.from_pretrained({auto}.from_pretrained(BASE), '{name}')"
    )


def _causal_lm_classes() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: set[str] = set()
    for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        out |= set(names) if isinstance(names, (list, tuple)) else {names}
    return out


def check_causal_lm(config: PretrainedConfig, name: str) -> None:
    """Refuse a model whose saved architectures include no causal LM (AutoModelForCausalLM would give it
    a new, random LM head): a reward model or critic (a score head) is named as one."""
    archs = list(getattr(config, "architectures", None) or [])
    lm_suffixes = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    if not archs or any(a in _causal_lm_classes() or a.endswith(lm_suffixes) for a in archs):
        return
    if any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"model '{name}' is a {archs[0]}: a reward model or critic (a score head), which scores "
            "sequences and does not generate. Load it with AutoModelForSequenceClassification; to "
            "generate, pass a causal LM (an export of a policy trained with model.head=lm)"
        )
    raise ValueError(
        f"model '{name}' is a {archs[0]}, not a causal LM: it has no LM head to generate or score tokens "
        "with. Pass a causal LM (config.json architectures such as LlamaForCausalLM)"
    )


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, attn: str | None = None):
    """`from_pretrained` on a local directory or hub name, with fp32 master weights by default and the
    family's attention implementation (`models.families.attn_implementation`) unless `attn` names one.
    A model saved as anything but a causal LM (a reward model) is refused (`check_causal_lm`)."""
    source, kwargs = hf_source(name_or_path)
    config = load_hf_config(name_or_path)
    check_causal_lm(config, name_or_path)
    attn = attn or attn_implementation(config)
    try:
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn, **kwargs)
    except OSError as e:
        raise ValueError(
            f"could not load model '{name_or_path}': {e}. Pass a local directory with config.json and "
            "weights, or a hub name reachable from this machine"
        ) from e


def load_tokenizer(
    name_or_path: str, elsewhere: str = "policy.model.tokenizer=DIR_OR_HUB_NAME"
) -> PreTrainedTokenizerBase:
    """Load a tokenizer; sets a pad token (the eos token) when the tokenizer has none. `elsewhere` is how
    the caller takes a tokenizer from another place, named when a directory has none."""
    source, kwargs = hf_source(name_or_path)
    path = Path(source)
    if path.is_dir() and not any((path / f).exists() for f in TOKENIZER_FILES):
        raise ValueError(
            f"model directory '{name_or_path}' has no tokenizer files (none of "
            f"{', '.join(TOKENIZER_FILES)}). "
            f"Save the tokenizer there (tokenizer.save_pretrained('{name_or_path}')), or take it from "
            f"elsewhere ({elsewhere})"
        )
    try:
        tok = AutoTokenizer.from_pretrained(source, **kwargs)
    except OSError as e:
        raise ValueError(f"could not load tokenizer '{name_or_path}': {e}") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def save_hf(model, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path, state_dict=None) -> Path:
    """Write a Hugging Face directory (safetensors + config + tokenizer) loadable by from_pretrained."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)  # loads back as itself through AutoTokenizer
    return out
