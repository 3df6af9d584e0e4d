"""A checkpoint's identity: the config pieces a run that resumes it must share with the run that saved it
(the `config` part of its fingerprint, checkpoint.py), which `posttrain export` also reads back to rebuild
its model (policy/export.py).

The model's head (`model.head`: a causal LM, or a scalar head for reward models and critics) is recorded
since checkpoints of scalar-head models could be exported; an older checkpoint lacks it, and its parameter
names tell (a scalar head's is `score.weight`).

A LoRA checkpoint holds the adapters alone, so it also records what identifies the frozen base's weights
(`model.base_weights`, `base_weights`): a local directory's weight files by a sha256 of their names,
sizes and chunks sampled over them, a hub model by its cached revision. A resume onto other base weights at the same path is refused; a checkpoint written
before the record existed, or a base whose weights cannot be read, counts as unknown and is not refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from posttrain import checkpoint
from posttrain.models.scalar_head import SCORE_HEAD, Head
from posttrain.policy.config import ModelConfig, PolicyConfig

HEAD = "model.head"
BASE = "model.base_weights"
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def checkpoint_identity(
    cfg: PolicyConfig, saved: dict[str, Any] | None = None, base: str | None = None
) -> dict[str, Any]:
    """The identity a checkpoint of a policy built from `cfg` holds (`base`: the `base_weights` of the
    model it was built from; recorded with LoRA); with `saved` (the identity of a checkpoint about to be
    loaded), without the head when that checkpoint predates it (its fingerprint's parameter names still
    tell a scalar head from an LM head), and with its base record (`check_lora_matches` compares them)."""
    m = cfg.model
    out = {
        "model.name": m.name,
        "model.tokenizer": m.tokenizer,
        "model.tiny": m.tiny.model_dump(mode="json") if m.name == "tiny" else None,
        HEAD: m.head,
        "optimizer.name": cfg.optimizer.name,
        "init_reference_model": cfg.init_reference_model,
        **_lora_identity(cfg, base),
    }
    if saved is not None and HEAD not in saved:
        del out[HEAD]
    if saved is not None and BASE in out:
        if BASE in saved:
            out[BASE] = saved[BASE]
        else:
            del out[BASE]
    return out


def _lora_identity(cfg: PolicyConfig, base: str | None) -> dict[str, Any]:
    """LoRA checkpoints hold the adapters alone: the base they were trained on must be rebuilt the same
    (the tiny model's seed, another model's weights), and the adapters' shape must match. Absent without
    LoRA, so full checkpoints keep their identity."""
    lora = cfg.lora
    if lora is None:
        return {}
    shape = lora.model_dump(mode="json", include={"rank", "alpha", "target_modules", "use_rslora"})
    return {"lora": shape, "model.seed": cfg.model.seed if cfg.model.name == "tiny" else None, BASE: base}


def base_weights(cfg: ModelConfig) -> str | None:
    """What identifies the weights `cfg.name` loads: for a local directory a sha256 of its weight files'
    names, sizes and sampled chunks (`_files_digest`), for a hub name the revision of its cached
    snapshot. None for the tiny model (its seed identifies it) or when neither can be read. The worker
    takes it once, when it builds the model."""
    if cfg.name == "tiny":
        return None
    path = Path(cfg.name).expanduser()
    if path.is_dir():
        files = sorted({f for pattern in WEIGHT_FILES for f in path.glob(pattern) if f.is_file()})
        return _files_digest(files) if files else None
    try:
        import huggingface_hub

        found = huggingface_hub.try_to_load_from_cache(cfg.name, "config.json")
    except Exception:  # not a hub name, no cache: unknown
        return None
    return f"revision:{Path(found).parent.name}" if isinstance(found, str) else None


SAMPLE_CHUNKS, CHUNK_BYTES = 16, 1 << 20  # per weight file: 16 MiB read, wherever in the file


def _files_digest(files: list[Path]) -> str:
    """sha256 over each file's name, size and SAMPLE_CHUNKS chunks of CHUNK_BYTES spread evenly over it
    (the whole file when it is smaller): every rank takes it when it builds a LoRA model, so it reads
    16 MiB per file, not the whole base (a 7B model's 15 GB would take ~15 s per rank). Other weights of
    the same shapes differ in every chunk; a change confined to bytes no chunk covers goes unseen."""
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        span = SAMPLE_CHUNKS * CHUNK_BYTES
        starts = (
            [0]
            if size <= span
            else [i * (size - CHUNK_BYTES) // (SAMPLE_CHUNKS - 1) for i in range(SAMPLE_CHUNKS)]
        )
        with open(file, "rb") as f:
            for start in starts:
                f.seek(start)
                digest.update(f.read(span if size <= span else CHUNK_BYTES))
    return f"sampled-sha256:{digest.hexdigest()}"


def saved_head(meta: dict[str, Any]) -> Head:
    """The head of a checkpoint's model (`meta`: its metadata): as recorded, or for a checkpoint from
    before heads were recorded, a scalar head where its parameters include one."""
    fingerprint = meta["fingerprint"]
    if HEAD in fingerprint["config"]:
        return fingerprint["config"][HEAD]
    return "score" if f"{SCORE_HEAD}.weight" in fingerprint["model"]["params"] else "lm"


def check_lora_matches(cfg: PolicyConfig, path: str, saved: dict[str, Any], base: str | None = None) -> None:
    """A full checkpoint in a LoRA run, or a LoRA checkpoint in a full run (`saved`: the checkpoint's
    identity): refused, naming the way across. So is a LoRA checkpoint whose base weights were others than
    `base` (this policy's `base_weights`; either unknown passes)."""
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
    if lora is not None and other_base(saved, base):
        raise ValueError(
            f"checkpoint '{path}' holds LoRA adapters trained on other base weights than those now in "
            f"policy.model.name={cfg.model.name!r} (checkpoint {saved[BASE]}, now {base}): the base model "
            "there was replaced. Point policy.model.name at the original base model to resume, or start a "
            "fresh run (another output_dir, or --overwrite)"
        )


def other_base(saved: dict[str, Any], base: str | None) -> bool:
    """Whether a LoRA checkpoint's identity `saved` records other base weights than `base`."""
    recorded = saved.get(BASE)
    return recorded is not None and base is not None and recorded != base


def saved_identity(path: str) -> dict[str, Any]:
    """The identity recorded in the checkpoint at `path`."""
    return checkpoint.read_metadata(path)["fingerprint"]["config"]
