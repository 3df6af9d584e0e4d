"""LoRA adapters on a Hugging Face causal LM, through `peft`: injection, the frozen base, merged and
adapter-only weights, and the peft adapter directory.

Adapters are injected in place (`peft.inject_adapter_in_model`): the model keeps its class, its forward
and its parameter names, plus `<layer>.base_layer.*` and `<layer>.lora_A/lora_B.default.weight` under
each targeted linear layer. Only the adapter parameters require gradients. The reference policy of a
LoRA run is the same model with its adapters disabled (`adapters_disabled`), so no copy of the weights
is kept for it.

An engine receives either merged weights (`merged_weights`: base + scaling * B @ A under the base
layer's own name, one layer at a time, so a full extra copy of the model never exists) or the adapter
tensors alone (`is_adapter_key`), when it carries the same adapters itself.

Departures from peft: adapters may not target the embedding or the LM head (the engine applies the
LM head itself and tensor parallelism shards both on the vocabulary), and only the initializations
that leave the base weights untouched are offered (PiSSA/OLoRA rewrite the base, which would make
"adapters disabled" a different model from the one the run started from). `all-linear` is resolved
here, to the model's own `nn.Linear` layers, and peft gets that list: peft 0.21 maps `all-linear` on
transformers-5 MoE models (Qwen3-MoE, Mixtral, OLMoE) to `target_parameters`, adapting the fused 3-D
expert tensors and the router's weight with nested `ParamWrapper` layers, which merge, weight sync and
export do not handle; such layers are refused, whatever the targets that led peft to them. MoE routers
are never adapted by `all-linear` (see `all_linear_targets`).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Literal

import torch
from pydantic import Field, field_validator

from posttrain.config import Config

ADAPTER = "default"  # peft's adapter name; one adapter per model
ALL_LINEAR = "all-linear"
_NOT_TARGETS = ("lm_head", "embed_tokens")


class LoraSettings(Config):
    """Low-rank adapters (peft LoRA) on the policy's linear layers; everything else stays frozen."""

    rank: int = Field(16, ge=1, description="adapter rank r")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: updates are scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input (training only)")
    target_modules: str | list[str] = Field(
        ALL_LINEAR,
        description="names of the linear layers to adapt (e.g. [q_proj, v_proj]; one name may be given "
        "bare), each matching at least one layer; 'all-linear' (every nn.Linear layer but the LM head, "
        "as peft's all-linear on linear layers; transformers 5 fuses MoE experts into 3-D tensors and "
        "makes routers no linear layers, so on Qwen3-MoE, Mixtral and OLMoE the attention projections); "
        "or a regular "
        "expression over full module paths, as peft reads one (e.g. '.*layers\\.0\\..*_proj')",
    )
    init: Literal["default", "gaussian"] = Field(
        "default", description="A's initialization (B starts at zero either way): kaiming-uniform or gaussian"
    )
    use_rslora: bool = Field(False, description="rank-stabilized scaling alpha / sqrt(rank)")
    seed: int = Field(0, description="seed of the adapters' initialization")
    engine: Literal["merged", "adapters"] = Field(
        "merged",
        description="what weight sync sends: merged weights (base + scaling * B @ A; any engine), or the "
        "adapter tensors alone (the engine holds the base once and applies the low-rank update itself)",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str) and re.fullmatch(r"\w+", v) and v != ALL_LINEAR:
            v = [v]  # one module name (peft would read a bare string as a regex over full module paths)
        names = [v] if isinstance(v, str) else v
        if not names:
            raise ValueError(
                "target_modules is empty; name modules (e.g. [q_proj, v_proj]) or use all-linear"
            )
        bad = [n for n in names if n in _NOT_TARGETS]
        if bad:
            raise ValueError(
                f"target_modules may not include {bad}: adapters go on the decoder's linear layers, the "
                "embedding and LM head stay frozen (remove them, or use all-linear)"
            )
        return v

    def peft_config(self):
        """The equivalent `peft.LoraConfig` (`all-linear` as written: `add_lora` resolves it for a model)."""
        import peft

        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
            init_lora_weights=True if self.init == "default" else "gaussian",
            use_rslora=self.use_rslora,
            bias="none",
        )


def add_lora(
    model: torch.nn.Module, settings: LoraSettings, exclude: tuple[str, ...] = ()
) -> torch.nn.Module:
    """Inject adapters into `model` in place (deterministic for `settings.seed`; on the meta device when
    the model is there), never into the modules named in `exclude`, and freeze everything else; returns
    the model."""
    import peft

    _check_targets(model, settings.target_modules)
    config = settings.peft_config()
    if settings.target_modules == ALL_LINEAR:
        config.target_modules = all_linear_targets(model, exclude)
    if exclude:
        config.exclude_modules = list(exclude)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        try:
            peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except ValueError as e:
            raise ValueError(
                f"policy.lora.target_modules={settings.target_modules!r} does not fit this model (peft: "
                f"{str(e).splitlines()[0][:160]}); name linear layers of its decoder (e.g. q_proj, v_proj) "
                "or use all-linear"
            ) from None
    _refuse_parameter_targets(model, settings.target_modules)
    frozen_only = [n for n in lora_layers(model) if n.rsplit(".", 1)[-1] in _NOT_TARGETS]
    if frozen_only:
        raise ValueError(
            f"policy.lora.target_modules={settings.target_modules!r} adapts {frozen_only}: the embedding and "
            "LM head stay frozen; narrow the expression to the decoder's linear layers (or use all-linear)"
        )
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))
    return model


def all_linear_targets(model: torch.nn.Module, exclude: tuple[str, ...] = ()) -> list[str]:
    """What `all-linear` adapts in `model`, as peft target names: every `nn.Linear` (or GPT-2 `Conv1D`)
    except the output embeddings (LM head), the embedding and the modules named in `exclude`: the
    layers peft's own all-linear adapts among linear layers (so a router that is an `nn.Linear`, as in
    transformers 4, is adapted as peft adapted it). In transformers 5 fused MoE experts are 3-D tensors and
    a router is a `*TopKRouter`, no linear layers: peft would reach them through `target_parameters`,
    which posttrain does not merge, sync or export."""
    from transformers.pytorch_utils import Conv1D

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = set(_NOT_TARGETS) | set(exclude)
    chosen = {
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear | Conv1D) and m is not output and n.rsplit(".", 1)[-1] not in skip
    }
    if not chosen:
        raise ValueError(
            "policy.lora.target_modules=all-linear: this model has no linear layer to adapt besides its "
            "LM head; name the modules to adapt (policy.lora.target_modules)"
        )
    return target_names(chosen, {n for n, _ in model.named_modules()})


def target_names(chosen: set[str], modules: Iterable[str]) -> list[str]:
    """peft target names that select exactly the modules `chosen` among `modules` (full paths): a
    module's last name where every module so named is chosen, its full path where it is not."""
    leaves: dict[str, set[str]] = {}
    for n in modules:
        leaves.setdefault(n.rsplit(".", 1)[-1], set()).add(n)
    out = set()
    for n in chosen:
        leaf = n.rsplit(".", 1)[-1]
        out.add(leaf if leaves.get(leaf, {n}) <= chosen else n)
    return sorted(out)


def _refuse_parameter_targets(model: torch.nn.Module, targets: str | list[str]) -> None:
    """Refuse adapters on parameters (peft's `ParamWrapper`, from `target_parameters`: peft maps targets
    such as an MoE family's down_proj or gate onto its fused experts and router), which posttrain does not
    merge, sync or export."""
    try:
        from peft.tuners.lora import ParamWrapper
    except ImportError:  # peft < 0.17 has no target_parameters: nothing can be wrapped so
        return

    wrapped = sorted(n for n, m in model.named_modules() if isinstance(m, ParamWrapper))
    if wrapped:
        shown = ", ".join(wrapped[:4]) + (f" and {len(wrapped) - 4} more" if len(wrapped) > 4 else "")
        raise ValueError(
            f"policy.lora.target_modules={targets!r} made peft adapt parameters, not linear layers ({shown}: "
            "the fused MoE experts or the router, through peft's target_parameters); posttrain adapts linear "
            "layers only. Use all-linear, or name the decoder's linear layers (e.g. [q_proj, k_proj, "
            "v_proj, o_proj])"
        )


def _check_targets(model: torch.nn.Module, targets: str | list[str]) -> None:
    """Refuse target names that match no linear layer (peft refuses only when none of the names matches
    anything, so a misspelt name next to a good one would silently leave its layers frozen)."""
    if isinstance(targets, str):
        return
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear | Conv1D)}
    bad = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear)]
    if bad:
        names = sorted({n.rsplit(".", 1)[-1] for n in linear} - set(_NOT_TARGETS))
        raise ValueError(
            f"policy.lora.target_modules: {bad} name no linear layer of this model; its linear layers "
            f"are {names}: name some of those, or use all-linear"
        )


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module name: peft LoRA layer} of every adapted layer."""
    if "peft" not in sys.modules:  # nothing can be adapted before peft is imported (it is, lazily)
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: torch.nn.Module) -> bool:
    return any(is_adapter_key(n) for n, _ in model.named_parameters())


def is_adapter_key(name: str) -> bool:
    """Whether a parameter or state-dict name belongs to an adapter."""
    return ".lora_A." in name or ".lora_B." in name


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model: every adapter layer computes its base layer alone inside the block."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """{adapted layer name: scaling} (alpha / rank, or alpha / sqrt(rank) with rsLoRA)."""
    return {n: float(m.scaling[ADAPTER]) for n, m in lora_layers(model).items()}


def merged_weights(
    named: Iterable[tuple[str, torch.Tensor]], scaling: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Merge a stream of full tensors of an adapted model into the base model's names and values:
    `<layer>.base_layer.weight` + scaling * B @ A becomes `<layer>.weight` (in fp32, cast back), other
    `base_layer.*` tensors lose the `base_layer.` part, adapter tensors are consumed. A layer's base
    weight is held only until its two adapter tensors have come by."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        layer, part = _split(name, scaling)
        if layer is None:
            yield name, t
            continue
        if part.startswith("base_layer.") and part != "base_layer.weight":
            yield f"{layer}.{part.removeprefix('base_layer.')}", t
            continue
        parts = pending.setdefault(layer, {})
        parts[part] = t
        if len(parts) == 3:
            del pending[layer]
            yield f"{layer}.weight", _merge(parts, scaling[layer])
    assert not pending, f"adapted layers without all of base/A/B in the stream: {sorted(pending)}"


def _split(name: str, scaling: dict[str, float]) -> tuple[str | None, str]:
    """(adapted layer, the rest of the name) for a tensor inside an adapted layer, else (None, name)."""
    for marker in (".base_layer.", f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."):
        layer, sep, _ = name.partition(marker)
        if sep and layer in scaling:
            return layer, name[len(layer) + 1 :]
    return None, name


def _merge(parts: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    base = parts["base_layer.weight"]
    a = parts[f"lora_A.{ADAPTER}.weight"].float()
    b = parts[f"lora_B.{ADAPTER}.weight"].float()
    return (base.float() + scale * (b @ a)).to(base.dtype)


def unload_merged(model: torch.nn.Module) -> torch.nn.Module:
    """Turn an adapted model back into its plain class, in place: every adapted layer is replaced by its
    base layer carrying the merged weight (as `merged_weights` merges it, one layer at a time); returns
    the model, which `save_pretrained` writes under the base model's names."""
    scale = scalings(model)
    for name, layer in lora_layers(model).items():
        tensors = [(f"{name}.{part}", p.detach()) for part, p in layer.named_parameters()]
        merged = dict(merged_weights(tensors, {name: scale[name]}))
        base = layer.get_base_layer()
        with torch.no_grad():
            base.weight.copy_(merged[f"{name}.weight"])
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, base)
    if hasattr(model, "peft_config"):  # set by peft's injection; the model has no adapters left
        del model.peft_config
    return model


def peft_state_dict(
    tensors: Iterable[tuple[str, torch.Tensor]], modules_to_save: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Adapter tensors, and those of the modules named in `modules_to_save` (trained in full, e.g. a
    scalar head's `score`), under the names `PeftModel.from_pretrained` reads (the adapter name dropped,
    `base_model.model.` in front)."""
    return {
        "base_model.model." + name.replace(f".{ADAPTER}.", "."): t.detach().cpu().contiguous()
        for name, t in tensors
        if is_adapter_key(name) or name.split(".", 1)[0] in modules_to_save
    }
