"""The rollout worker of a real asynchronous GRPO run: a generation engine that draws a prompt's G
completions, scores them with the task's reward and returns them stamped with their weight version,
in this process (`EngineRolloutWorker`) or in a Ray actor of its own (`EngineRolloutActor`).

It is configured by the synchronous `GRPOConfig` of the run (async_grpo_run.sync_equivalent), so
scoring is grpo.score itself: failed rewards are marked and masked, never 0. Departures:
- a group is drawn with a seed derived from (seed, prompt id, weight version), sample k from the
  engine's random stream k of that seed, so a group retried after its worker died is drawn again
  identically, whatever worker takes it; the G requests of all the groups of a call enter the engine
  together;
- the rewards of a call's groups run in one call on a thread once they are generated.
  `task.reward.max_failed_fraction` is checked per step by the trainer side (as grpo.py checks it per
  step batch), not per group; a `RewardError` (`on_reward_error: raise`) fails its group alone (a
  `RolloutFailure` result): the group is retried, then reported (`max_retries`);
- in the same thread call, the worker lays out the groups' training rows (`attach_rows`: advantages
  within each group, failed samples masked, exactly as grpo.samples_to_batch does) as numpy arrays,
  so the trainer only stacks them (`stack_rows`): the work leaves the trainer, the busier side;
- weights arrive as one `WeightsPayload` (state dict packed into one byte buffer + the trainer's probe
  logprobs, one `ray.put` per version under Ray); the worker loads it between requests and checks its
  own logprobs on the probe batch (generation/probe.py); a failed check raises `WeightSyncError` and
  the controller retires the worker. Requests for the new version may come before the load: they
  wait for it (and its check), so the next requests travel while the last old ones finish.
"""

from __future__ import annotations

import asyncio
import math
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from tensordict import TensorDict

from posttrain.algorithms.async_types import GroupResult, RolloutFailure, SamplesCodec, WorkerLostError
from posttrain.algorithms.async_workers import RayRolloutWorker
from posttrain.algorithms.grpo import GRPOConfig, GRPOLoopConfig, engine_config, samples_to_batch, score
from posttrain.config import Config
from posttrain.data.batch import make_batch
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationResult
from posttrain.generation.weight_sync import WeightSync
from posttrain.policy.model_init import build_tokenizer, load_full_model
from posttrain.tasks.build import build_task
from posttrain.tasks.datasets import PromptItem
from posttrain.tasks.rewards import RewardError
from posttrain.tasks.task import Task


class RolloutConfig(Config):
    """Where the rollout workers (one generation engine each) run."""

    backend: Literal["local", "ray"] = Field(
        "local", description="local: engines in this process; ray: one engine per Ray actor process"
    )
    num_workers: int = Field(1, ge=1, description="rollout workers (engines)")
    num_cpus_per_worker: float = Field(1.0, gt=0, description="Ray CPUs reserved per rollout actor")
    num_gpus_per_worker: float = Field(0.0, ge=0, description="Ray GPUs reserved per rollout actor")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads per rollout actor (None: Ray's default)"
    )
    ray_address: str | None = Field(None, description="existing Ray cluster; default starts one on loopback")
    start_timeout_s: float = Field(300.0, gt=0, description="bound on starting the rollout actors")


@dataclass
class GroupSamples:
    """A scored prompt group: what a rollout worker returns inside its GroupResult."""

    prompt_id: int
    results: list[GenerationResult]
    rewards: list[float]  # NaN where the reward failed
    failed: list[bool]
    metrics: dict[str, float] = field(default_factory=dict)  # reward summary, timings, probe check
    rows: dict[str, np.ndarray] | None = None  # training rows (attach_rows), None until laid out


# --------------------------------------------------------------------------- training rows

ROW_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask", "generation_logprobs", "advantages")


def pad_token_id(tokenizer: Any) -> int:
    """The id that right-pads training rows (the trainer and the rollout workers must agree)."""
    return tokenizer.pad_token_id or 0


def attach_rows(groups: list[GroupSamples], loop: GRPOLoopConfig, pad_id: int) -> None:
    """Lay out the training rows of every group that has none yet: their rows of grpo.samples_to_batch
    over these groups (advantages within each group; failed and, with overlong_filtering, truncated
    samples masked), as numpy arrays cut to the group's longest row: cheap to pickle, and `stack_rows`
    of any groups' rows is their batch. One samples_to_batch call serves all the groups."""
    todo = [s for s in groups if s.rows is None]
    if not todo:
        return
    sizes = torch.tensor([len(s.results) for s in todo])
    batch, _ = samples_to_batch(
        [r for s in todo for r in s.results],
        torch.tensor([r for s in todo for r in s.rewards], dtype=torch.float32),
        torch.tensor([f for s in todo for f in s.failed], dtype=torch.bool),
        torch.arange(len(todo)).repeat_interleave(sizes),
        loop,
        pad_id,
    )
    arrays = {k: batch[k].numpy() for k in ROW_KEYS}
    first = 0
    for s, n in zip(todo, sizes.tolist()):
        rows = slice(first, first + n)
        width = int(arrays["input_lengths"][rows].max())
        s.rows = {k: a[rows] if a.ndim == 1 else a[rows, :width] for k, a in arrays.items()}
        first += n


def stack_rows(groups: list[dict[str, np.ndarray]], pad_id: int) -> TensorDict:
    """The batch of several groups' rows (`attach_rows`), right-padded to the longest row of them all."""
    width = max(g["input_ids"].shape[1] for g in groups)
    n = sum(len(g["input_lengths"]) for g in groups)
    out = {}
    for key in ROW_KEYS:
        first = groups[0][key]
        if first.ndim == 1:
            out[key] = torch.from_numpy(np.concatenate([g[key] for g in groups]))
            continue
        full = np.full((n, width), pad_id if key == "input_ids" else 0, dtype=first.dtype)
        row = 0
        for g in groups:
            rows, cols = g[key].shape
            full[row : row + rows, :cols] = g[key]
            row += rows
        out[key] = torch.from_numpy(full)
    return make_batch(**out)


# --------------------------------------------------------------------------- codec and weights


def _encode(s: GroupSamples) -> dict[str, Any]:
    out = asdict(replace(s, rows=None))  # the rows are rebuilt from the results after a resume
    del out["rows"]
    out["rewards"] = [None if f else r for r, f in zip(s.rewards, s.failed)]
    out["metrics"] = {k: v for k, v in s.metrics.items() if math.isfinite(v)}
    return out


def _decode(d: dict[str, Any]) -> GroupSamples:
    rewards = [math.nan if r is None else float(r) for r in d["rewards"]]
    results = [GenerationResult(**r) for r in d["results"]]
    return GroupSamples(d["prompt_id"], results, rewards, list(d["failed"]), dict(d["metrics"]))


SAMPLES_CODEC = SamplesCodec(_encode, _decode)  # buffered groups survive a checkpoint (JSON)


def _to_bytes(t: torch.Tensor) -> tuple[Any, torch.dtype, tuple[int, ...]]:
    """A tensor as a flat uint8 numpy array (any dtype, bf16 included) with its dtype and shape."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy(), t.dtype, tuple(t.shape)


def _from_bytes(data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():  # Ray hands out read-only buffers; loading copies them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data).view(dtype).reshape(shape)


_ALIGN = 64  # byte alignment of each tensor inside a packed buffer

# (name, dtype, shape, byte offset, byte size) of each tensor in a packed buffer
PackIndex = list[tuple[str, torch.dtype, tuple[int, ...], int, int]]


def _pack_index(tensors: dict[str, torch.Tensor]) -> tuple[PackIndex, int]:
    index, size = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        index.append((name, t.dtype, tuple(t.shape), size, n))
        size += -(-n // _ALIGN) * _ALIGN
    return index, size


def packed_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes `pack_tensors` needs for `tensors`."""
    return _pack_index(tensors)[1]


def pack_tensors(
    tensors: dict[str, torch.Tensor], out: np.ndarray | None = None
) -> tuple[np.ndarray, PackIndex]:
    """Copy `tensors` (any dtype, device, layout) into one flat uint8 buffer, `out` when it is large
    enough (reused across weight versions), else a new one. One buffer pickles, and crosses to a Ray
    actor, with much less per-tensor overhead than one array per tensor."""
    index, size = _pack_index(tensors)
    buf = out if out is not None and out.nbytes >= size else np.empty(size, dtype=np.uint8)
    buf = buf[:size]
    base = torch.from_numpy(buf)
    for (_, dtype, shape, offset, n), t in zip(index, tensors.values()):
        base[offset : offset + n].view(dtype).view(shape).copy_(t.detach())
    return buf, index


def unpack_tensors(buf: np.ndarray, index: PackIndex) -> dict[str, torch.Tensor]:
    """Views of the tensors of a `pack_tensors` buffer (no copy)."""
    with warnings.catch_warnings():  # Ray hands out read-only buffers; loading copies them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        base = torch.from_numpy(buf)
    return {name: base[o : o + n].view(dtype).view(shape) for name, dtype, shape, o, n in index}


def _rebuild_payload(
    version: int, packed: tuple[np.ndarray, PackIndex], probe: Any, temperature: float
) -> WeightsPayload:
    probe_logprobs = None if probe is None else _from_bytes(*probe)
    return WeightsPayload(version, unpack_tensors(*packed), probe_logprobs, temperature)


@dataclass
class WeightsPayload:
    """One weight version for the rollout workers: the full state dict and the trainer's logprobs on
    the probe batch (None when the probe check is off), taken together.

    Pickled (one `ray.put` per version) as one flat byte buffer (`pack_tensors`), which Ray stores
    and hands to the actor without copying; torch tensors would be pickled, then unpickled by every
    reader. `buffer` (e.g. the previous version's) is filled instead of a new one when large enough:
    `ray.put` has copied it into the object store by the time it returns."""

    version: int
    state: dict[str, torch.Tensor]
    probe_logprobs: torch.Tensor | None
    temperature: float
    buffer: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        packed = pack_tensors(self.state, self.buffer)
        probe = None if self.probe_logprobs is None else _to_bytes(self.probe_logprobs)
        return _rebuild_payload, (self.version, packed, probe, self.temperature)


def only_group(results: list[GroupResult]) -> GroupResult:
    """The one group of a one-prompt `generate_groups` call; a failed group raises RolloutFailure."""
    (result,) = results
    if result.error is not None:
        raise RolloutFailure(result.error)
    return result


def group_seed(seed: int, prompt_id: int, weight_version: int) -> int:
    """Seed of a group (sample k draws from the engine's stream k of it): the same prompt at the same
    weights draws the same completions."""
    return (seed * 1_000_003 + prompt_id * 10_007 + weight_version * 7_919 + 17) % (2**31)


def probe_sync(cfg: GRPOConfig, vocab_size: int) -> WeightSync:
    """The probe batch and its check, built identically on the trainer side and in every worker."""
    return WeightSync(cfg.weight_sync, vocab_size, dp_size=cfg.policy.dp_size)


@dataclass
class _ScoreView:
    """What grpo.score reads of a `Run`: cfg.grpo, cfg.sampling, tokenizer and task."""

    cfg: GRPOConfig
    tokenizer: Any
    task: Task


class EngineRolloutWorker:
    """A `RolloutWorker` over an in-process `GenerationEngine` (see the module docstring).

    Several groups may be in flight at once: they share the engine's continuous batch. `set_weights`
    may come while they are: it waits for them (`loads_between_requests`). A call for the version being
    loaded (or for a newer one not announced yet) waits until it is loaded and checked, so the
    controller sends the next requests with the new weights instead of after them; a call for an older
    version fails (`RolloutFailure`, retried). After a failed load or generation step every call fails
    with `WorkerLostError` (the controller retires the worker). The `*_blocking` methods serve a caller
    that runs one call at a time, in order (the Ray actor)."""

    loads_between_requests = True

    def __init__(self, cfg: GRPOConfig, engine: GenerationEngine, task: Task, name: str = "") -> None:
        self.cfg = cfg
        self.engine = engine
        self.task = task
        self.name = name or "engine-worker"
        self._score_view = _ScoreView(cfg, engine.tokenizer, task)
        self._pad_id = pad_token_id(engine.tokenizer)
        self._sync = probe_sync(cfg, engine.vocab_size) if cfg.weight_sync.probe.enabled else None
        self._sync_metrics: dict[str, float] = {}
        self._running: set[asyncio.Task] = set()  # generate calls in flight (set_weights waits for them)
        self._loading: int | None = None  # the version a set_weights in progress loads
        self._loaded = asyncio.Event()  # set (and replaced) whenever a set_weights ends
        self._loaded_loop: asyncio.AbstractEventLoop | None = None
        self._broken: str | None = None  # why the last load failed (the engine's weights are suspect)

    async def _tracked(self, call: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            return await call
        finally:
            self._running.discard(task)

    @classmethod
    def build(cls, cfg: GRPOConfig, name: str = "") -> EngineRolloutWorker:
        """Tokenizer, task (for its reward) and an engine of the policy's model; the weights it starts
        with are replaced by the first `set_weights`."""
        tokenizer = build_tokenizer(cfg.policy.model)
        reward = cfg.task.reward
        if reward.on_reward_error == "skip_sample":  # the trainer side checks the fraction per step
            reward = reward.model_copy(update={"max_failed_fraction": 1.0})
        task = build_task(cfg.task.model_copy(update={"reward": reward}), tokenizer)
        model = load_full_model(cfg.policy.model, tokenizer)
        return cls(cfg, GenerationEngine(model, tokenizer, engine_config(cfg, task)), task, name)

    async def generate_group(self, prompt: PromptItem, weight_version: int) -> GroupResult:
        """Generate and score the `num_generations_per_prompt` completions of `prompt`, and lay out
        their training rows."""
        return only_group(await self.generate_groups([prompt], weight_version))

    async def generate_groups(self, prompts: list[PromptItem], weight_version: int) -> list[GroupResult]:
        """`generate_group` for several prompts at once: all their completions enter the engine's
        batch together, and are scored and laid out in one call on a thread. A group whose reward
        fails comes back with `error` set (it alone is retried)."""
        await self._await_version(weight_version)
        # tracked from here on, in the same turn of the event loop: a set_weights waits for this call
        return await self._tracked(self._generate_scored(prompts, weight_version))

    async def _await_version(self, version: int) -> None:
        """Return once the engine holds `version` (loaded and checked) and no newer load is pending."""
        while True:
            self._check_not_broken()
            held = self.engine.weight_version
            if self._loading is None and version == held:  # loaded and checked
                return
            newest = held if self._loading is None else max(held, self._loading)
            if version < newest:  # e.g. a Ray call overtaken by the set_weights sent after it
                raise RolloutFailure(
                    f"{self.name}: asked for weight version {version}, but the engine holds (or is "
                    f"loading) {newest}"
                )
            await self._version_event().wait()  # a newer version is loading, or on its way: wait for it

    def _version_event(self) -> asyncio.Event:
        """The event the next set_weights sets, of the running event loop (a local worker may serve
        several runs, each with its own loop)."""
        loop = asyncio.get_running_loop()
        if self._loaded_loop is not loop:
            self._loaded, self._loaded_loop = asyncio.Event(), loop
        return self._loaded

    async def _generate_scored(self, prompts: list[PromptItem], weight_version: int) -> list[GroupResult]:
        g = self.cfg.grpo.num_generations_per_prompt
        generated = await asyncio.gather(*(self._generate(p, weight_version, g) for p in prompts))
        return await asyncio.to_thread(self._score_groups, prompts, generated, weight_version)

    def _requests(self, prompt: PromptItem, weight_version: int) -> tuple[list[int], Any]:
        """A group's prompt and sampling parameters: its G requests share them, with the group's seed
        (request k draws from stream k of it)."""
        seed = group_seed(self.cfg.grpo.seed, prompt.prompt_id, weight_version)
        return list(prompt.prompt_token_ids), self.cfg.sampling.model_copy(update={"seed": seed})

    async def _generate(
        self, prompt: PromptItem, weight_version: int, g: int
    ) -> tuple[list[GenerationResult], float]:
        """The group's completions and their seconds."""
        ids, params = self._requests(prompt, weight_version)
        t0 = time.perf_counter()
        results = await self.engine.agenerate_all([ids] * g, params)
        return results, time.perf_counter() - t0

    def _check_payload(self, version: int, weights: WeightsPayload) -> None:
        if weights.version != version:
            raise ValueError(
                f"{self.name}: asked to load version {version}, got a payload of {weights.version}"
            )

    def _mark_broken(self, what: str, error: BaseException) -> None:
        """After this, every call fails with WorkerLostError (`_check_not_broken`)."""
        self._broken = f"{what}: {type(error).__name__}: {error}"

    def _check_not_broken(self) -> None:
        if self._broken is not None:  # the pool retires a lost worker and retries its groups elsewhere
            raise WorkerLostError(f"{self.name}: the engine is unusable after {self._broken}")

    def _score_groups(
        self,
        prompts: list[PromptItem],
        generated: list[tuple[list[GenerationResult], float]],
        weight_version: int,
    ) -> list[GroupResult]:
        """Blocking: score each group (a failed reward fails its group alone) and lay out the rows."""
        g = self.cfg.grpo.num_generations_per_prompt
        out = []
        for prompt, (results, seconds) in zip(prompts, generated):
            t0 = time.perf_counter()
            try:
                rewards, failed, summary = score(self._score_view, [prompt], results)
            except RewardError as e:
                error = f"{self.name}: reward of prompt {prompt.prompt_id} failed: {e}"
                out.append(GroupResult(None, weight_version, g, error=error))
                continue
            versions = {r.weight_version for r in results}
            stamp = versions.pop() if len(versions) == 1 else -1  # mixed versions: the controller refuses it
            timings = {"generation_s": seconds, "reward_s": time.perf_counter() - t0}
            group_metrics = {**summary, **timings, **self._sync_metrics}
            samples = GroupSamples(
                prompt.prompt_id, results, rewards.tolist(), failed.tolist(), group_metrics
            )
            out.append(GroupResult(samples, stamp, g))
        attach_rows([r.samples for r in out if r.error is None], self.cfg.grpo, self._pad_id)
        return out

    async def set_weights(self, version: int, weights: WeightsPayload) -> None:
        """Load `weights` once the generate calls in flight have finished (they keep their version),
        then check the engine's logprobs on the probe batch; calls for `version` that come meanwhile
        wait for both."""
        self._check_payload(version, weights)
        self._loading = version  # calls for it wait, calls for older versions fail, until the check
        try:
            while running := [t for t in self._running if not t.done()]:
                await asyncio.wait(running)
            t0 = time.perf_counter()
            await self.engine.load_weights_async(weights.state, version)
            seconds = time.perf_counter() - t0
            await asyncio.to_thread(self._check_loaded, weights, version, seconds)
        except Exception as e:  # a cancelled push is not a failed load: the controller pushes again
            self._mark_broken(f"loading weight version {version} failed", e)
            raise
        finally:
            self._loading = None
            self._version_event().set()  # wake the calls waiting for a version
            self._loaded = asyncio.Event()

    def _check_loaded(self, weights: WeightsPayload, version: int, seconds: float) -> None:
        """Blocking: the engine's logprobs on the probe batch against the trainer's (WeightSyncError
        if they differ); the sync's metrics go out with the next groups."""
        metrics = {"weight_sync/seconds": seconds}
        if self._sync is not None and weights.probe_logprobs is not None:
            lp = self.engine.compute_logprobs(self._sync.probe.sequences, weights.temperature)
            checked = self._sync.check(lp, weights.probe_logprobs, version)  # raises WeightSyncError
            metrics |= {f"weight_sync/{k}": v for k, v in checked.items()}
        self._sync_metrics = metrics

    # ------------------------------------------------------------------ blocking (a Ray actor)

    def generate_groups_blocking(self, prompts: list[PromptItem], weight_version: int) -> list[GroupResult]:
        """`generate_groups` in the calling thread: the engine steps here until the groups are done.
        For a caller that runs one call at a time, in order (`EngineRolloutActor`): the engine must
        already hold `weight_version`."""
        self._check_not_broken()
        if weight_version != self.engine.weight_version:
            raise RolloutFailure(
                f"{self.name}: asked for weight version {weight_version}, but the engine holds "
                f"{self.engine.weight_version}"
            )
        g = self.cfg.grpo.num_generations_per_prompt
        requests = [self._requests(p, weight_version) for p in prompts]
        ids = self.engine.submit_all(  # all validated before any is queued
            [tokens for tokens, _ in requests for _ in range(g)],
            [params for _, params in requests for _ in range(g)],
            streams=list(range(g)) * len(prompts),
        )
        pending = {rid: i // g for i, rid in enumerate(ids)}
        done: dict[int, GenerationResult] = {}
        seconds = [0.0] * len(prompts)
        t0 = time.perf_counter()
        try:
            while pending:
                for r in self.engine.step():
                    i = pending.pop(r.request_id)
                    done[r.request_id] = r
                    seconds[i] = time.perf_counter() - t0  # the group's last result sets its time
        except BaseException as e:  # its requests may be left in the engine: no later call can trust it
            self._mark_broken("a generation step failed", e)
            raise
        generated = [([done[rid] for rid in ids[i * g : (i + 1) * g]], s) for i, s in enumerate(seconds)]
        return self._score_groups(prompts, generated, weight_version)

    def set_weights_blocking(self, version: int, weights: WeightsPayload) -> None:
        """`set_weights` in the calling thread, between calls (the engine is idle)."""
        self._check_payload(version, weights)
        try:
            t0 = time.perf_counter()
            self.engine.load_weights(weights.state, version)
            self._check_loaded(weights, version, time.perf_counter() - t0)
        except Exception as e:
            self._mark_broken(f"loading weight version {version} failed", e)
            raise


class EngineRolloutActor:
    """The body of a Ray rollout actor: one `EngineRolloutWorker` (one engine) per actor process.

    A synchronous actor: Ray runs its calls one at a time in the order the controller sent them (one
    submitter, no task retries), on the actor's main thread, where the engine steps. So a
    `set_weights` sent while a call generates runs right after it, and the calls sent after it run
    on the new weights, without a round trip in between (`loads_between_requests`); and no event
    loop or thread hand-off costs the actor CPU per call. Weights arrive as an ObjectRef of a
    `WeightsPayload` (Ray resolves it before `set_weights` runs)."""

    def __init__(self, cfg: GRPOConfig, name: str, torch_threads: int | None = None) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.worker = EngineRolloutWorker.build(cfg, name)

    def ready(self) -> str:
        return self.worker.name

    def generate_group(self, prompt: PromptItem, weight_version: int) -> GroupResult:
        return only_group(self.worker.generate_groups_blocking([prompt], weight_version))

    def generate_groups(self, prompts: list[PromptItem], weight_version: int) -> list[GroupResult]:
        return self.worker.generate_groups_blocking(prompts, weight_version)

    def set_weights(self, version: int, weights: WeightsPayload) -> None:
        self.worker.set_weights_blocking(version, weights)


def start_ray_workers(cfg: GRPOConfig, rollout: RolloutConfig) -> tuple[list[RayRolloutWorker], list[Any]]:
    """Start `rollout.num_workers` actors; wait (bounded) until each has built its engine.

    Returns the controller-facing workers and the actor handles (to kill them at the end)."""
    from posttrain.parallel.cluster import ensure_ray

    ray = ensure_ray(rollout.ray_address)
    # no task retries: they would void Ray's in-order execution of a synchronous actor's calls
    opts = {
        "num_cpus": rollout.num_cpus_per_worker,
        "num_gpus": rollout.num_gpus_per_worker,
        "max_task_retries": 0,
    }
    actor_cls = ray.remote(**opts)(EngineRolloutActor)
    names = [f"rollout-{i}" for i in range(rollout.num_workers)]
    actors = [actor_cls.remote(cfg, name, rollout.torch_threads) for name in names]
    try:
        ray.get([a.ready.remote() for a in actors], timeout=rollout.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        for a in actors:
            ray.kill(a)
        raise TimeoutError(
            f"the rollout actors did not start within rollout.start_timeout_s={rollout.start_timeout_s}s "
            "(not enough free CPUs/GPUs in the Ray cluster for rollout.num_cpus_per_worker?)"
        ) from None
    workers = [
        RayRolloutWorker(a, name=n, loads_between_requests=True, serial_calls=True)
        for a, n in zip(actors, names)
    ]
    return workers, actors


def start_local_workers(cfg: GRPOConfig, rollout: RolloutConfig) -> list[EngineRolloutWorker]:
    """`rollout.num_workers` engines in this process."""
    return [EngineRolloutWorker.build(cfg, f"rollout-{i}") for i in range(rollout.num_workers)]
