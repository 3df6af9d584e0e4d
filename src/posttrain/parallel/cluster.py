"""Worker groups: the same worker class run in-process (`local`) or as one Ray actor per rank (`ray`).

Ray is imported lazily, so the local backend runs without it. Every wait is bounded by
`cluster.timeout_s`; a timeout raises `TimeoutError` naming the verb.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

from pydantic import Field

from posttrain.config import Config
from posttrain.logging import get_logger
from posttrain.parallel.mesh import free_port

log = get_logger(__name__)


class ClusterConfig(Config):
    """Where the ranks run."""

    backend: Literal["local", "ray"] = Field(
        "local", description="local: in-process, one rank; ray: one actor per rank"
    )
    num_workers: int = Field(1, ge=1, description="data-parallel ranks (ray backend)")
    ray_address: str | None = Field(
        None, description="existing Ray cluster; default starts one bound to loopback"
    )
    timeout_s: float = Field(600.0, gt=0, description="bound on every wait for a worker")
    num_cpus_per_worker: float = Field(1.0, gt=0)
    num_gpus_per_worker: float = Field(0.0, ge=0)


def ensure_ray(address: str | None = None, num_cpus: int | None = None):
    """Import Ray and start (or join) it; a new local instance binds to loopback only."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("cluster.backend='ray' needs Ray: pip install 'posttrain[ray]'") from e
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if address:
            kwargs["address"] = address
        else:
            kwargs.update(_node_ip_address="127.0.0.1", num_cpus=num_cpus or 8)
        ray.init(**kwargs)
    return ray


def _put_shared(per_rank: list[tuple]) -> list[tuple]:
    """Put each argument that several ranks get (the ranks of one data-parallel shard under tensor or
    context parallelism) into Ray's object store once; Ray hands every rank the value behind the ref."""
    import ray

    counts = Counter(id(a) for args in per_rank for a in args)
    refs: dict[int, Any] = {}
    return [
        tuple(refs.setdefault(id(a), ray.put(a)) if counts[id(a)] > 1 else a for a in args)
        for args in per_rank
    ]


class WorkerGroup:
    """`world_size` instances of `worker_cls(*args, rank=r, world_size=n, ...)`, called together."""

    def __init__(self, worker_cls: type, cluster: ClusterConfig, *args: Any, **kwargs: Any) -> None:
        self.backend = cluster.backend
        self.world_size = cluster.num_workers
        self.timeout_s = cluster.timeout_s
        if self.backend == "local":
            self.workers = [worker_cls(*args, rank=0, world_size=1, **kwargs)]
            return
        ray = ensure_ray(cluster.ray_address)
        actor_cls = ray.remote(num_cpus=cluster.num_cpus_per_worker, num_gpus=cluster.num_gpus_per_worker)(
            worker_cls
        )
        port = free_port()
        self.workers = [
            actor_cls.remote(
                *args, rank=r, world_size=self.world_size, master_addr="127.0.0.1", master_port=port, **kwargs
            )
            for r in range(self.world_size)
        ]
        self.get([w.__ray_ready__.remote() for w in self.workers], "start workers")

    def get(self, refs: list[Any], what: str) -> list[Any]:
        """Wait for Ray object refs (bounded by the cluster timeout)."""
        if self.backend == "local":
            return refs
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"{what}: workers did not answer within cluster.timeout_s={self.timeout_s}s"
            ) from None

    def submit(
        self, method: str, *args: Any, per_rank: list[tuple] | None = None, **kwargs: Any
    ) -> list[Any]:
        """Start `method` on every rank (rank r gets `*per_rank[r]` first when given); returns refs/results."""
        if per_rank is not None and self.backend == "ray":
            per_rank = _put_shared(per_rank)
        out = []
        for r, w in enumerate(self.workers):
            rank_args = tuple(per_rank[r]) if per_rank is not None else ()
            if self.backend == "local":
                out.append(getattr(w, method)(*rank_args, *args, **kwargs))
            else:
                out.append(getattr(w, method).remote(*rank_args, *args, **kwargs))
        return out

    def run(self, method: str, *args: Any, per_rank: list[tuple] | None = None, **kwargs: Any) -> list[Any]:
        """`submit` and wait for all ranks."""
        return self.get(self.submit(method, *args, per_rank=per_rank, **kwargs), method)

    def shutdown(self) -> None:
        if self.backend == "ray":
            import ray

            for w in self.workers:
                ray.kill(w)
        self.workers = []
