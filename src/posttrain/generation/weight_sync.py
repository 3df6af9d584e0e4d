"""Refit: the trainer's weights into generation engines, with a version number, checked on a probe.

Three transports, one contract (a stream of full, unsharded `(name, tensor)` pairs in, a complete
`engine.load_weights(...)` with a version out):

- Same process: `iter_full_weights(model)` gathers FSDP2 (DTensor) parameters one at a time;
  the engine copies them (`load_weights`) or aliases them (`share_weights`, zero copy, when dtype
  and device match and nothing is sharded).
- Other processes: a dedicated torch.distributed group (`WeightSyncGroup`: gloo on CPU, NCCL on GPU)
  built from its own TCPStore, independent of the trainer's default group. Rank 0 (the trainer side)
  broadcasts buckets of at most `bucket_mb` (a single larger tensor travels alone), each packed into
  one buffer by generation/payload.py; each bucket is preceded by a header with names, shapes,
  dtypes, offsets and the version.
- CUDA IPC: for an engine in another process on the same GPU, the sender fills one device buffer per
  bucket and hands out an IPC handle to it (`iter_ipc_buckets`); the engine copies out of it
  (`load_ipc_bucket`) before the sender refills the buffer. No copy through the host.

After every sync `WeightSync` compares engine and trainer logprobs on a fixed probe batch
(generation/probe.py) and fails loudly above the threshold. One exception: a shared sync that finds the
engine already aliasing every trainer tensor after a passed probe (nothing moved; see `sync_local`).
"""

from __future__ import annotations

import pickle
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch.distributed.tensor import DTensor

from posttrain.config import Config
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.payload import PackEntry, aligned, pack_tensors, unpack_tensors
from posttrain.generation.probe import ProbeBatch, ProbeConfig, check_probe, probe_metrics
from posttrain.generation.weights import WeightLoad
from posttrain.logging import get_logger
from posttrain.parallel.mesh import free_port, iter_full_weights

log = get_logger(__name__)


class WeightSyncConfig(Config):
    """How weights travel from the trainer to the engines, and how the result is checked."""

    bucket_mb: float = Field(256.0, gt=0, description="bucket size bound for broadcast and CUDA IPC (MiB)")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="cross-process group backend; auto = nccl when CUDA is available, else gloo"
    )
    timeout_s: float = Field(300.0, gt=0, description="bound on every wait of a cross-process sync")
    share: Literal["auto", "never"] = Field(
        "auto",
        description="in-process refit: auto = the engine aliases the trainer's tensors (zero copy) when "
        "the loop allows it (trainer in this process, unsharded, same device and dtype as the engine, "
        "device not time-shared); never = always copy",
    )
    probe: ProbeConfig = Field(default_factory=ProbeConfig)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


# ---------------------------------------------------------------------------- in-process


def sync_model(model: torch.nn.Module, engine: GenerationEngine, version: int, share: bool = False):
    """In-process refit from a trainer module: copy (gathering FSDP shards) or share its tensors."""
    if share:
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ValueError("share=True needs unsharded parameters; FSDP-sharded trainers sync by copy")
        return engine.share_weights(model.state_dict(), version)
    return engine.load_weights(iter_full_weights(model, unique=True), version)


# ---------------------------------------------------------------------------- buckets


@dataclass
class BucketHeader:
    """What the next bucket holds; `final` marks the end of a sync (no buffer follows)."""

    version: int
    entries: list[PackEntry] = field(default_factory=list)  # the bucket's pack index
    nbytes: int = 0
    final: bool = False


def plan_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into buckets of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in weights:
        n = aligned(t.numel() * t.element_size())
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def pack_bucket(
    bucket: list[tuple[str, torch.Tensor]], version: int, buffer: torch.Tensor | None, device: torch.device
) -> tuple[BucketHeader, torch.Tensor]:
    """Pack a bucket's tensors into one uint8 buffer (`buffer` when large enough, else a new one on
    `device`); return its header and the buffer to reuse for the next bucket (its first
    `header.nbytes` bytes hold this one)."""
    packed, index = pack_tensors(bucket, buffer, device)
    header = BucketHeader(version=version, entries=index, nbytes=packed.numel())
    return header, packed if buffer is None or packed.numel() > buffer.numel() else buffer


def unpack_bucket(header: BucketHeader, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of the tensors of a received bucket (valid until the buffer is reused)."""
    yield from unpack_tensors(buffer, header.entries).items()


# ---------------------------------------------------------------------------- cross-process group


@dataclass(frozen=True)
class SyncGroupInfo:
    """Everything a process needs to join a weight-sync group (picklable, sent to the engines)."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float


def new_group_info(num_engines: int, cfg: WeightSyncConfig, host: str = "127.0.0.1") -> SyncGroupInfo:
    """A group of the sender (rank 0) and `num_engines` engine processes (ranks 1..n)."""
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return SyncGroupInfo(host, free_port(), num_engines + 1, backend, cfg.timeout_s)


class WeightSyncGroup:
    """A process group made directly from a TCPStore (not the default group): the trainer's own
    collectives and this group never interfere. Every rank constructs it at the same time."""

    def __init__(self, info: SyncGroupInfo, rank: int) -> None:
        self.info, self.rank = info, rank
        timeout = timedelta(seconds=info.timeout_s)
        store = dist.TCPStore(info.host, info.port, info.world_size, rank == 0, timeout)
        if info.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, info.world_size, opts)
        elif info.backend == "gloo":
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(store, rank, info.world_size, timeout)
        else:
            raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {info.backend!r}")
        self._store = store

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Send a picklable object from `src`; every rank returns it."""
        size = torch.zeros(1, dtype=torch.long, device=self.device)
        data = b""
        if self.rank == src:
            data = pickle.dumps(obj)
            size[0] = len(data)
        self.broadcast(size, src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, src)
        return obj if self.rank == src else pickle.loads(buf.cpu().numpy().tobytes())


def broadcast_weights(
    group: WeightSyncGroup | None,
    weights: Iterable[tuple[str, torch.Tensor]],
    version: int,
    bucket_bytes: int,
) -> dict[str, float]:
    """Send full weights from rank 0 of `group` to every engine, in buckets, with the version.

    Trainer ranks other than the sender pass `group=None`: they only walk the iterator (which, for
    FSDP, takes part in the parameter gathers)."""
    start, nbytes, buckets = time.perf_counter(), 0, 0
    buffer = None
    for bucket in plan_buckets(weights, bucket_bytes):
        if group is None:
            continue
        header, buffer = pack_bucket(bucket, version, buffer, group.device)
        group.broadcast_object(header)
        group.broadcast(buffer[: header.nbytes])
        nbytes += sum(e.nbytes for e in header.entries)
        buckets += 1
    if group is not None:
        group.broadcast_object(BucketHeader(version=version, final=True))
    return {"bytes": float(nbytes), "buckets": float(buckets), "seconds": time.perf_counter() - start}


_SENDER_GROUPS: dict[SyncGroupInfo, WeightSyncGroup] = {}


@dataclass(frozen=True)
class BroadcastSink:
    """A picklable sender to hand to a trainer worker (`sink(iter_full_weights(model), rank)` on every
    rank): rank 0 joins the group as its sender (once per process, then reused) and broadcasts; the
    other ranks only walk the iterator, taking part in the FSDP gathers. Weights then go from the
    trainer's process straight to the engines, not through the driver."""

    info: SyncGroupInfo
    version: int
    bucket_bytes: int

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]], rank: int) -> dict[str, float]:
        group = None
        if rank == 0:
            group = _SENDER_GROUPS.get(self.info)
            if group is None:
                group = _SENDER_GROUPS[self.info] = WeightSyncGroup(self.info, 0)
        return broadcast_weights(group, weights, self.version, self.bucket_bytes)


def receive_weights(group: WeightSyncGroup, engine: GenerationEngine) -> dict[str, float]:
    """Engine side of `broadcast_weights`: receive every bucket into the engine, then check completeness.

    If the engine rejects a tensor, the remaining buckets are still received (so the sender never
    hangs) and the error is raised afterwards."""
    start = time.perf_counter()
    load: WeightLoad | None = None
    error: Exception | None = None
    while True:
        header: BucketHeader = group.broadcast_object(None)
        if header.final:
            break
        buffer = torch.empty(header.nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(buffer)
        if error is not None:
            continue
        try:
            load = load or engine.begin_load()
            for name, tensor in unpack_bucket(header, buffer):
                load.add(name, tensor)
        except Exception as e:  # keep draining; re-raised below
            error = e
    if error is not None:
        raise error
    if load is None:
        raise ValueError("the weight sync sent no tensors; the engine keeps its previous weights")
    stats = load.finish(header.version)
    return {**stats, "seconds": time.perf_counter() - start, "version": float(header.version)}


# ---------------------------------------------------------------------------- CUDA IPC


@dataclass
class IpcBucket:
    """One bucket shared over CUDA IPC: a handle to the sender's device buffer and its header."""

    header: BucketHeader
    handle: tuple | None  # torch.multiprocessing.reductions.reduce_tensor(buffer); None when final


def iter_ipc_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int, device: torch.device
) -> Iterator[IpcBucket]:
    """Fill one device buffer per bucket and yield an IPC handle to it; the buffer is refilled only
    when the next bucket is requested, so deliver each bucket (and wait for the engine) first.
    The last item is a final marker without a buffer."""
    from torch.multiprocessing.reductions import reduce_tensor

    buffer = None
    for bucket in plan_buckets(weights, bucket_bytes):
        header, buffer = pack_bucket(bucket, version, buffer, device)
        torch.cuda.current_stream(device).synchronize()  # the engine reads it from another process
        yield IpcBucket(header, reduce_tensor(buffer))
    yield IpcBucket(BucketHeader(version=version, final=True), None)


def push_ipc(
    weights: Iterable[tuple[str, torch.Tensor]],
    version: int,
    deliver: Callable[[IpcBucket], Any],
    bucket_bytes: int,
    device: torch.device,
) -> dict[str, float]:
    """Sender loop of a CUDA IPC sync: `deliver(bucket)` must return once the engine has copied it
    (e.g. `lambda b: ray.get(engine.load_ipc_bucket.remote(b))`)."""
    start, nbytes = time.perf_counter(), 0
    for bucket in iter_ipc_buckets(weights, version, bucket_bytes, device):
        deliver(bucket)
        nbytes += sum(e.nbytes for e in bucket.header.entries)
    return {"bytes": float(nbytes), "seconds": time.perf_counter() - start}


class IpcReceiver:
    """Engine side of a CUDA IPC sync: opens each bucket's handle and copies out of it."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self._load: WeightLoad | None = None

    def load_bucket(self, bucket: IpcBucket) -> dict[str, float] | None:
        """Copy one bucket into the engine; on the final marker, check completeness and set the version."""
        if bucket.header.final:
            load, self._load = self._load, None
            if load is None:
                raise ValueError("the CUDA IPC sync sent no tensors; the engine keeps its previous weights")
            return load.finish(bucket.header.version)
        self._load = self._load or self.engine.begin_load()
        rebuild, args = bucket.handle
        buffer = rebuild(*args)
        for name, tensor in unpack_bucket(bucket.header, buffer):
            self._load.add(name, tensor)
        torch.cuda.current_stream(buffer.device).synchronize()  # done reading before the sender refills
        del buffer
        return None


# ---------------------------------------------------------------------------- checked sync from a Policy


class WeightSync:
    """Refit engines from a `Policy` and check each refit on the probe batch.

    The trainer's probe logprobs are computed first (the trainer must be on its device then); a
    colocated run may offload the trainer between `trainer_probe()` and the refit."""

    def __init__(self, cfg: WeightSyncConfig, vocab_size: int, dp_size: int = 1) -> None:
        self.cfg = cfg
        self.probe = ProbeBatch(cfg.probe, vocab_size, multiple_of=dp_size)
        self._verified_shares: weakref.WeakSet = weakref.WeakSet()  # engines whose aliasing passed a probe

    def trainer_probe(self, policy) -> torch.Tensor:
        """[B, T] trainer logprobs of the probe batch (at the trainer's logprob temperature)."""
        return policy.get_logprobs(self.probe.batch)

    def check(self, engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, version: int) -> dict:
        """Probe metrics; raises `WeightSyncError` above the threshold."""
        metrics = probe_metrics(engine_logprobs, trainer_logprobs, self.probe)
        check_probe(metrics, self.cfg.probe, version)
        return metrics

    def sync_local(
        self, policy, engine: GenerationEngine, version: int, share: bool = False
    ) -> dict[str, float]:
        """In-process refit from a Policy (any backend; `share` needs the local backend).

        A shared sync that finds the engine already aliasing every trainer tensor, after a probe passed
        on that aliasing, transfers nothing that could go wrong: the engine computes with the very
        memory the optimizer just updated. When the trainer also computes as the engine does (fp32,
        no autocast; see `same_arithmetic`) it is not probed again (`probe.recheck_shared` to force);
        otherwise the probe keeps measuring the precision gap, which grows as the weights move. Any
        re-pointed tensor (a trainer that replaced a parameter, an engine loaded by copy in between)
        brings the probe back."""
        if share:
            start = time.perf_counter()
            stats = sync_model(_local_model(policy), engine, version, share=True)
            metrics = self._metrics(stats, start, version)
            if not self.cfg.probe.enabled:
                return metrics
            verified = stats["tensors_repointed"] == 0 and engine in self._verified_shares
            if verified and same_arithmetic(policy, engine) and not self.cfg.probe.recheck_shared:
                return metrics | {"probe_skipped": 1.0}
            metrics |= self._check_local(policy, engine, self.trainer_probe(policy), version)
            self._verified_shares.add(engine)
            return metrics
        self._verified_shares.discard(engine)  # a copy-load ends any aliasing
        reference = self.trainer_probe(policy) if self.cfg.probe.enabled else None
        start = time.perf_counter()
        metrics = self._metrics(engine.load_weights(policy.engine_state_dict(), version), start, version)
        if reference is not None:
            metrics |= self._check_local(policy, engine, reference, version)
        return metrics

    @staticmethod
    def _metrics(stats: dict, start: float, version: int) -> dict[str, float]:
        return {"seconds": time.perf_counter() - start, "bytes": stats["bytes"], "version": float(version)}

    def _check_local(self, policy, engine: GenerationEngine, reference: torch.Tensor, version: int) -> dict:
        lp = engine.compute_logprobs(self.probe.sequences, policy.cfg.scoring_temperature)
        return self.check(lp, reference, version)

    def sync_remote(self, policy, engines: list, group: WeightSyncGroup, version: int) -> dict[str, float]:
        """Refit Ray engine actors (`RolloutEngine`) that joined `group` as ranks 1..n; this process is
        the sender (rank 0) and relays the Policy's gathered weights."""
        import ray

        reference = self.trainer_probe(policy) if self.cfg.probe.enabled else None
        weights = policy.engine_state_dict()
        pending = [e.receive_weights.remote() for e in engines]
        stats = broadcast_weights(group, weights.items(), version, self.cfg.bucket_bytes)
        ray.get(pending, timeout=self.cfg.timeout_s)
        metrics = {"seconds": stats["seconds"], "bytes": stats["bytes"], "version": float(version)}
        if reference is not None:
            temperature = policy.cfg.scoring_temperature
            refs = [e.compute_logprobs.remote(self.probe.sequences, temperature) for e in engines]
            worst: dict[str, float] = {}
            for lp in ray.get(refs, timeout=self.cfg.timeout_s):
                m = self.check(lp, reference, version)
                worst = {k: max(v, worst.get(k, v)) for k, v in m.items()}
            metrics |= worst
        return metrics


def same_arithmetic(policy, engine: GenerationEngine) -> bool:
    """Whether the trainer computes logprobs as the engine does: an fp32 trainer (no autocast) and an
    fp32 engine. A bf16-autocast trainer sharing its fp32 master weights with an fp32 engine does not:
    their logprob gap grows with training, and only a probe measures it."""
    return policy.cfg.precision == "float32" and engine.dtype == torch.float32


def can_share(policy, engine: GenerationEngine) -> bool:
    """Whether `engine` can alias the trainer's tensors: the Policy runs one unsharded rank in this
    process, on the engine's device, in the engine's dtype."""
    if policy.cfg.cluster.backend != "local" or policy.cfg.lora is not None:
        return False  # LoRA: the engine computes with merged weights (or its own adapters), not aliases
    return all(
        not isinstance(p, DTensor) and _same_device(p.device, engine.device) and p.dtype == engine.dtype
        for p in _local_model(policy).parameters()
    )


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, reading a missing index ('cuda') as the current one."""

    def index(d: torch.device):
        if d.index is None and d.type == "cuda":
            return torch.cuda.current_device()
        return d.index

    return a.type == b.type and index(a) == index(b)


def _local_model(policy) -> torch.nn.Module:
    """The trainer's module when the Policy runs in this process (local backend)."""
    if policy.cfg.cluster.backend != "local":
        raise ValueError("share=True needs cluster.backend='local' (the trainer in this process)")
    return policy.group.workers[0].model
