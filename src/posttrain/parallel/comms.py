"""Tearing down and rebuilding a worker's device communicators, so training and generation can time-share
a device (DESIGN.md, "Worker phases": communicators are a second, independent switch).

A colocated run moves the trainer off the device while the engine generates. Its process groups would
still hold device memory (NCCL communicator buffers) and, on CPU, sockets and threads. This module
destroys them and later recreates them, without rebuilding the model or the optimizer:

1. `collect_groups` walks the worker's meshes (data, context and tensor parallel) and every FSDP2
   state of the model (param groups, params, their mesh infos and communication helpers, the DTensor
   specs of the sharded params) and records each process group found (deduplicated by identity)
   together with every place that refers to it (a "holder": an attribute, a list slot, a mesh's group
   name or registry entry).
2. `teardown` replaces every holder's reference by a `TornDownGroup` placeholder (a stray use raises
   `CommsError` instead of silently running on another group) and destroys each group. Dropping the
   references matters: gloo frees a group's sockets and threads only when the Python object dies.
3. `rebuild` creates one new group per destroyed one (same ranks, backend, description, timeout) and
   writes it into every holder; mesh dimensions are renamed to the new groups. The `DeviceMesh` objects
   keep their identity, so every DTensor (params, gradients, optimizer state) keeps working and the next
   step trains exactly as if nothing happened.

Departures from the textbook "destroy all groups and re-init": the default (world) group is never
destroyed here; it stays up as the rendezvous whose store creates the new groups. That is why
`parallel/mesh.build_dp_mesh` builds the mesh over its own group. A model whose mesh uses the default
group is refused with a `ValueError`. Host-side groups (gloo) held next to device (NCCL) groups on a
GPU are left alone; on CPU, gloo is the device backend and its groups are torn down.

Failures raise `CommsError` naming the group; the snapshot records what is done, so calling the same
function again finishes the job. Teardown is local to the rank. Rebuild is collective over the default
group: the ranks exchange their group lists and create every group in one agreed order, so that each
new group gets a fresh name (a reused name would reuse the destroyed group's rendezvous keys).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = [
    "CommsError",
    "CommsSnapshot",
    "GroupSpec",
    "TornDownGroup",
    "collect_groups",
    "rebuild",
    "teardown",
]


class CommsError(RuntimeError):
    """A process group could not be destroyed or created, or a torn-down group was used."""


class TornDownGroup:
    """Stands in for a destroyed process group until `rebuild`; any use raises `CommsError`."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # keep copy/pickle/inspection protocols working
            raise AttributeError(attr)
        raise CommsError(
            f"process group '{self.name}' is torn down (its `{attr}` was used); call rebuild_comms() first"
        )

    def __repr__(self) -> str:
        return f"TornDownGroup({self.name!r})"


@dataclass(frozen=True)
class GroupSpec:
    """What is needed to recreate one process group."""

    name: str
    desc: str
    ranks: tuple[int, ...]
    backend: str
    timeout_s: float | None

    def describe(self) -> str:
        return f"'{self.name}' ({self.desc}, backend {self.backend}, ranks {list(self.ranks)})"


@dataclass
class _Holder:
    """One reference to a group: obj.<key> ('attr'), obj[key] ('item'), mesh._dim_group_names[key]
    ('name') or mesh._pg_registry[key] ('registry')."""

    kind: str
    obj: Any
    key: Any
    group: int


@dataclass
class CommsSnapshot:
    """The groups of one worker, where they are referenced, and how far teardown/rebuild got."""

    device_type: str
    meshes: list[DeviceMesh]
    groups: list[GroupSpec]
    holders: list[_Holder]
    live: list[Any]  # the old group while not yet destroyed, else None
    plan: list[GroupSpec] | None = None  # every rank's groups, in the order all ranks create them
    mine: list[int] = field(default_factory=list)  # plan index of each of this rank's groups
    created: list[Any] = field(default_factory=list)  # per plan entry: new group, None (not a member)
    detached: bool = False
    rebuilt: bool = False

    @property
    def mesh_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(m.shape) for m in self.meshes]

    @property
    def mesh_dim_names(self) -> list[tuple[str, ...] | None]:
        return [m.mesh_dim_names for m in self.meshes]

    @property
    def torn_down(self) -> bool:
        return all(g is None for g in self.live)


# ---------------------------------------------------------------------------------------------- collect


def _is_device_group(pg: dist.ProcessGroup, device_type: str) -> bool:
    """On CPU every group is a device group; on an accelerator, groups without a non-gloo backend for
    it are host-side. A group already destroyed is none: torch's sharding-propagation cache can hand a
    new model DTensor specs whose mesh holds the groups of a process group destroyed before it (seen
    after `destroy_process_group` and a new FSDP model in the same process), and there is nothing left
    of those to tear down."""
    if pg not in dist.distributed_c10d._world.pg_group_ranks:
        return False
    if device_type == "cpu":
        return True
    try:
        return pg._get_backend(torch.device(device_type)).name() != "gloo"
    except RuntimeError:
        return False


def _group_spec(pg: dist.ProcessGroup, device_type: str) -> GroupSpec:
    timeout_s = None
    try:
        timeout_s = pg._get_backend(torch.device(device_type)).options._timeout.total_seconds()
    except (RuntimeError, AttributeError):
        pass
    return GroupSpec(
        name=pg.group_name,
        desc=pg.group_desc,
        ranks=tuple(dist.get_process_group_ranks(pg)),
        backend=str(dist.get_backend(pg)),
        timeout_s=timeout_s,
    )


class _Walker:
    """Finds process groups and their holders among FSDP2 internals, meshes and DTensor specs."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.seen: set[int] = set()
        self.meshes: list[DeviceMesh] = []
        self.groups: list[dist.ProcessGroup] = []
        self.index: dict[int, int] = {}
        self.holders: list[_Holder] = []

    def _group_index(self, pg: dist.ProcessGroup) -> int | None:
        if not _is_device_group(pg, self.device_type):
            return None
        if id(pg) not in self.index:
            if pg is dist.group.WORLD:
                raise ValueError(
                    "the model's mesh uses the default (world) process group, which cannot be torn down "
                    "on its own; build the mesh with posttrain.parallel.mesh.build_mesh (its own groups; a "
                    "context-parallel mesh without tensor parallelism has them from torch 2.9 on)"
                )
            self.index[id(pg)] = len(self.groups)
            self.groups.append(pg)
        return self.index[id(pg)]

    def _hold(self, kind: str, obj: Any, key: Any, pg: dist.ProcessGroup) -> None:
        i = self._group_index(pg)
        if i is not None:
            self.holders.append(_Holder(kind, obj, key, i))

    def visit(self, obj: Any) -> None:
        if id(obj) in self.seen or obj is None or isinstance(obj, (str, int, float, bool)):
            return
        self.seen.add(id(obj))
        if isinstance(obj, DeviceMesh):
            self._visit_mesh(obj)
        elif isinstance(obj, DTensorSpec):
            self.visit(obj.mesh)
        elif isinstance(obj, DTensor):
            self.visit(obj._spec)
        elif isinstance(obj, (torch.Tensor, torch.nn.Module)):
            return
        elif isinstance(obj, (list, dict)):
            items = enumerate(obj) if isinstance(obj, list) else list(obj.items())
            for key, value in items:
                self._child("item", obj, key, value)
        elif isinstance(obj, (tuple, set, frozenset)):
            for value in obj:
                if isinstance(value, dist.ProcessGroup) and _is_device_group(value, self.device_type):
                    raise CommsError(f"process group '{value.group_name}' is held in a {type(obj).__name__}")
                self.visit(value)
        elif type(obj).__module__.startswith("torch.distributed") and hasattr(obj, "__dict__"):
            for key, value in list(vars(obj).items()):
                self._child("attr", obj, key, value)

    def _child(self, kind: str, obj: Any, key: Any, value: Any) -> None:
        if isinstance(value, dist.ProcessGroup):
            self._hold(kind, obj, key, value)
        else:
            self.visit(value)

    def _visit_mesh(self, mesh: DeviceMesh) -> None:
        self.meshes.append(mesh)
        for i, name in enumerate(getattr(mesh, "_dim_group_names", [])):
            # (a name can outlive its group, destroyed with its process group: see _is_device_group)
            try:
                pg = _resolve_process_group(name)
            except RuntimeError:
                continue
            self._hold("name", mesh, i, pg)
        for name, pg in list(mesh._pg_registry.items()):
            self._hold("registry", mesh, name, pg)
        self.visit(mesh._root_mesh)
        for sub in mesh._flatten_mapping.values():
            self.visit(sub)


def fsdp_states(model: torch.nn.Module) -> list[Any]:
    """The FSDP2 state of every `fully_shard`-ed module of `model`, in module order."""
    return [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]


def collect_groups(
    models: torch.nn.Module | Sequence[torch.nn.Module] | None,
    mesh: DeviceMesh | Sequence[DeviceMesh] | None = None,
    device_type: str | None = None,
) -> CommsSnapshot:
    """Every device process group that `mesh` (one or several) and `models` hold, and every reference
    to it (no side effects). The order is deterministic, so ranks with the same layout list their groups
    alike. Pass every mesh object that code outside the model's parameters holds (tensor-parallel
    hooks and context-parallel attention keep their own submesh objects), so each is re-bound.

    Pass every FSDP model of the process at once: torch's sharding-propagation cache hands a model the
    DTensor specs (hence the mesh) of an earlier model whose mesh compares equal, so models built in one
    process can share meshes, and a group torn down for one must be re-bound in all.
    """
    if isinstance(models, torch.nn.Module):
        models = [models]
    models = list(models or [])
    meshes = [mesh] if isinstance(mesh, DeviceMesh) else list(mesh or [])
    if device_type is None:
        device_type = meshes[0].device_type if meshes else _model_device_type(models)
    walker = _Walker(device_type)
    for m in meshes:
        walker.visit(m)
    for model in models:
        for state in fsdp_states(model):
            walker.visit(state)
        for p in model.parameters():
            walker.visit(p)
    specs = [_group_spec(pg, device_type) for pg in walker.groups]
    meshes = [m for m in walker.meshes if m._root_mesh is None] or walker.meshes
    return CommsSnapshot(device_type, meshes, specs, walker.holders, list(walker.groups))


def _model_device_type(models: list[torch.nn.Module]) -> str:
    states = [s for m in models for s in fsdp_states(m)]
    return states[0]._device.type if states else "cpu"


# ---------------------------------------------------------------------------------------------- teardown


def _device_used_bytes(device_type: str) -> int | None:
    """Bytes in use on this rank's device (whole device, so communicator buffers count), or None on CPU."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _destroy(pg: dist.ProcessGroup) -> None:
    """Destroy one group (module-level so tests can inject a failure)."""
    dist.destroy_process_group(pg)


def _create(spec: GroupSpec) -> dist.ProcessGroup:
    """Create one group like `spec`; every rank calls it (module-level so tests can inject a failure)."""
    timeout = timedelta(seconds=spec.timeout_s) if spec.timeout_s is not None else None
    return dist.new_group(list(spec.ranks), timeout=timeout, backend=spec.backend, group_desc=spec.desc)


def _detach(snap: CommsSnapshot) -> None:
    """Replace every reference to the old groups by a placeholder (once)."""
    if snap.detached:
        return
    for h in snap.holders:
        name = snap.groups[h.group].name
        if h.kind == "attr":
            vars(h.obj)[h.key] = TornDownGroup(name)
        elif h.kind == "item":
            h.obj[h.key] = TornDownGroup(name)
        elif h.kind == "registry":
            h.obj._pg_registry.pop(h.key, None)
        elif h.kind == "name":  # a name no group can take: resolving it fails until rebuild
            h.obj._dim_group_names[h.key] = f"torn-down:{name}"
    snap.detached = True


def _stats(snap: CommsSnapshot, key: str, count: int, start: float, before: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {key: count}
    after = _device_used_bytes(snap.device_type)
    if before is not None and after is not None:
        out.update(device_used_before_bytes=before, device_used_after_bytes=after)
        out["device_freed_bytes"] = before - after
    out["seconds"] = time.perf_counter() - start
    return out


def _forget_cached_specs() -> None:
    """Drop DTensor's sharding-propagation cache: it hands out output specs, hence meshes, of earlier
    calls whose inputs compared equal, so a model built later in this process with an equal mesh would
    get a mesh of ours and run on its torn-down groups."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()


def teardown(snap: CommsSnapshot) -> dict[str, Any]:
    """Destroy the groups of `snap` (idempotent). Returns groups_destroyed, seconds and, on a device,
    device_used_before_bytes / device_used_after_bytes / device_freed_bytes.

    Raises `CommsError` naming the first group that could not be destroyed; the groups destroyed so far
    stay destroyed and calling `teardown(snap)` again retries the rest.
    """
    if snap.rebuilt:
        raise ValueError("this snapshot was already rebuilt; take a new one with collect_groups()")
    start = time.perf_counter()
    before = _device_used_bytes(snap.device_type)
    _detach(snap)
    _forget_cached_specs()
    destroyed = 0
    for i in range(len(snap.live)):
        if snap.live[i] is None:
            continue
        try:
            _destroy(snap.live[i])
        except Exception as e:
            raise CommsError(
                f"failed to destroy process group {snap.groups[i].describe()}: {e}; "
                f"{destroyed} group(s) destroyed before it. Call teardown_comms() again to retry"
            ) from e
        snap.live[i] = None  # the last reference: gloo releases sockets and threads here
        destroyed += 1
    return _stats(snap, "groups_destroyed", destroyed, start, before)


def _world_plan(snap: CommsSnapshot) -> tuple[list[GroupSpec], list[int]]:
    """Every group of every rank, in one order all ranks agree on, and where this rank's groups are in it.

    Groups are created world-collectively (`new_group` without local synchronization) because only then
    does each get a fresh name: a reused name would reuse the store keys of the destroyed group (gloo's
    and NCCL's rendezvous would read stale addresses or ids). The rank lists are exchanged over the
    default group, which is never torn down.
    """
    own, seen = [], {}
    for spec in snap.groups:
        key = (spec.ranks, spec.backend, spec.desc, spec.timeout_s)
        seen[key] = seen.get(key, -1) + 1
        own.append((*key, seen[key]))  # the n-th group with this signature on this rank
    everyone = [own]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, own)
    index: dict[tuple, int] = {}
    for keys in everyone:
        for key in keys:
            index.setdefault(tuple(key), len(index))
    plan = [GroupSpec("", desc, tuple(ranks), backend, t) for ranks, backend, desc, t, _ in index]
    mine = [index[key] for key in own]
    for spec, i in zip(snap.groups, mine):
        plan[i] = replace(plan[i], name=spec.name)  # this rank's old name, for messages
    return plan, mine


_PENDING = object()


def rebuild(snap: CommsSnapshot) -> tuple[DeviceMesh | None, dict[str, Any]]:
    """Recreate the groups of `snap` and re-bind them everywhere they were referenced (collective: every
    rank of the default group calls it). Finishes a partial teardown first. Returns (the first mesh
    found, stats: groups_created (this rank's), groups_destroyed, seconds, device bytes as in `teardown`).

    Raises `CommsError` naming the group that could not be created; groups already created are kept,
    and calling `rebuild(snap)` again (on every rank) creates the rest.
    """
    mesh = snap.meshes[0] if snap.meshes else None
    if snap.rebuilt:
        return mesh, {"groups_created": 0, "groups_destroyed": 0, "seconds": 0.0}
    start = time.perf_counter()
    before = _device_used_bytes(snap.device_type)
    destroyed = teardown(snap)["groups_destroyed"]  # finishes a partial teardown; 0 otherwise
    if snap.plan is None:
        try:
            snap.plan, snap.mine = _world_plan(snap)
        except Exception as e:
            raise CommsError(f"could not agree on the groups to create over the default group: {e}") from e
        snap.created = [_PENDING] * len(snap.plan)
    rank, created = (dist.get_rank() if dist.is_initialized() else 0), 0
    for i, spec in enumerate(snap.plan):
        if snap.created[i] is not _PENDING:
            continue
        try:
            pg = _create(spec)
        except Exception as e:
            raise CommsError(
                f"failed to create process group {spec.describe()}: {e}; the groups before it are kept. "
                "Call rebuild_comms() again (on every rank) to retry"
            ) from e
        snap.created[i] = pg if rank in spec.ranks else None
        created += rank in spec.ranks
    _rebind(snap)
    stats = _stats(snap, "groups_created", created, start, before)
    stats["groups_destroyed"] = destroyed
    return mesh, stats


def _rebind(snap: CommsSnapshot) -> None:
    for h in snap.holders:
        pg = snap.created[snap.mine[h.group]]
        if h.kind == "attr":
            vars(h.obj)[h.key] = pg
        elif h.kind == "item":
            h.obj[h.key] = pg
        elif h.kind == "registry":
            h.obj._pg_registry[pg.group_name] = pg
        elif h.kind == "name":
            h.obj._dim_group_names[h.key] = pg.group_name
    snap.rebuilt = True
