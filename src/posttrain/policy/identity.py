"""A checkpoint's identity: the config pieces a run that resumes it must share with the run that saved it
(the `config` part of its fingerprint, checkpoint.py), which `posttrain export` also reads back to rebuild
its model (policy/export.py).

The model's head (`model.head`: a causal LM, or a scalar head for reward models and critics) is recorded
since checkpoints of scalar-head models could be exported; an older checkpoint lacks it, and its parameter
names tell (a scalar head's is `score.weight`).
"""

from __future__ import annotations

from typing import Any

from posttrain import checkpoint
from posttrain.models.scalar_head import SCORE_HEAD, Head
from posttrain.policy.config import PolicyConfig

HEAD = "model.head"


def checkpoint_identity(cfg: PolicyConfig, saved: dict[str, Any] | None = None) -> dict[str, Any]:
    """The identity a checkpoint of a policy built from `cfg` holds; with `saved` (the identity of a
    checkpoint about to be loaded), without the head when that checkpoint predates it (its fingerprint's
    parameter names still tell a scalar head from an LM head)."""
    m = cfg.model
    out = {
        "model.name": m.name,
        "model.tokenizer": m.tokenizer,
        "model.tiny": m.tiny.model_dump(mode="json") if m.name == "tiny" else None,
        HEAD: m.head,
        "optimizer.name": cfg.optimizer.name,
        "init_reference_model": cfg.init_reference_model,
        **_lora_identity(cfg),
    }
    if saved is not None and HEAD not in saved:
        del out[HEAD]
    return out


def _lora_identity(cfg: PolicyConfig) -> dict[str, Any]:
    """LoRA checkpoints hold the adapters alone: the base they were trained on must be rebuilt the same
    (the tiny model's seed), and the adapters' shape must match. Absent without LoRA, so full checkpoints
    keep their identity."""
    lora = cfg.lora
    if lora is None:
        return {}
    shape = lora.model_dump(mode="json", include={"rank", "alpha", "target_modules", "use_rslora"})
    return {"lora": shape, "model.seed": cfg.model.seed if cfg.model.name == "tiny" else None}


def saved_head(meta: dict[str, Any]) -> Head:
    """The head of a checkpoint's model (`meta`: its metadata): as recorded, or for a checkpoint from
    before heads were recorded, a scalar head where its parameters include one."""
    fingerprint = meta["fingerprint"]
    if HEAD in fingerprint["config"]:
        return fingerprint["config"][HEAD]
    return "score" if f"{SCORE_HEAD}.weight" in fingerprint["model"]["params"] else "lm"


def check_lora_matches(cfg: PolicyConfig, path: str, saved: dict[str, Any]) -> None:
    """A full checkpoint in a LoRA run, or a LoRA checkpoint in a full run (`saved`: the checkpoint's
    identity): refused, naming the way across."""
    lora = saved.get("lora")
    if lora is None and cfg.lora is not None:
        raise ValueError(
            f"checkpoint '{path}' is a full fine-tuning checkpoint and this run trains LoRA adapters "
            "(policy.lora is set); it cannot resume it. Either unset policy.lora to resume it, or "
            f"export it (posttrain export {path} <dir>) and start a LoRA run with model.name=<dir>"
        )
    if lora is not None and cfg.lora is None:
        raise ValueError(
            f"checkpoint '{path}' holds LoRA adapters (policy.lora: {lora}) and this run is full "
            "fine-tuning; set the same policy.lora to resume it, or export it merged (posttrain "
            f"export {path} <dir>) and start a full run with model.name=<dir>"
        )


def saved_identity(path: str) -> dict[str, Any]:
    """The identity recorded in the checkpoint at `path`."""
    return checkpoint.read_metadata(path)["fingerprint"]["config"]
