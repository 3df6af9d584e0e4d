"""The engine rollout worker: a generation engine that draws a prompt's G completions, scores them with
the task's reward and returns them stamped with their weight version (`EngineRolloutWorker`, in this
process; rollout/ray_worker.py runs one in a Ray actor).

It samples and scores with the same helpers as the synchronous loop (rollout/groups.py): failed rewards
are marked and masked, never 0. Departures from the synchronous loop:
- a group is drawn with a seed derived from (seed, prompt id, weight version) (`group_seed`; and the
  prompt's `repeat` when the controller sends one prompt again at the same weights), sample k from the
  engine's random stream k of that seed, so a group retried after its worker died is drawn again
  identically, whatever worker takes it; the G requests of all the groups of a call enter the
  engine together;
- the rewards of a call's groups run in one call on a daemon thread once they are generated (never the
  event loop's executor, which `asyncio.run` joins without a bound: a reward that hangs past the
  controller's request timeout is abandoned, and the run still ends).
  `task.reward.max_failed_fraction` is checked per step by the trainer side, not per group; a
  `RewardError` (`on_reward_error: raise`) fails its group alone (a result with `error`): the group is
  retried, then reported (`max_retries`);
- in the same thread call, the worker lays out the groups' training rows (`attach_rows`, equal to
  `samples_to_batch`) as numpy arrays, so the trainer only stacks them: the work leaves the trainer,
  the busier side;
- weights arrive as one `WeightsPayload` (generation/payload.py); the worker loads it between requests
  and checks its own logprobs on the probe batch (generation/probe.py); a failed check raises
  `WeightSyncError` and the controller retires the worker. Requests for the new version may come
  before the load: they wait for it (and its check), so the next requests travel while the last old
  ones finish.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from posttrain.envs.build import EnvSuite, build_env
from posttrain.envs.tools import daemon_call
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationResult
from posttrain.generation.payload import WeightsPayload
from posttrain.models.tokenizer import pad_token_id
from posttrain.policy.model_init import build_tokenizer, engine_model
from posttrain.rollout.config import RolloutWorkerConfig
from posttrain.rollout.contracts import GroupResult, RolloutFailure, RolloutWorker, WorkerLostError
from posttrain.rollout.episodes import play_groups, trajectory_rewards
from posttrain.rollout.groups import engine_config, group_seed, probe_sync, score
from posttrain.rollout.rows import GroupSamples, attach_rows
from posttrain.tasks.build import build_task
from posttrain.tasks.datasets import PromptItem
from posttrain.tasks.rewards import RewardError
from posttrain.tasks.task import Task


def only_group(results: list[GroupResult]) -> GroupResult:
    """The one group of a one-prompt `generate_groups` call; a failed group raises RolloutFailure."""
    (result,) = results
    if result.error is not None:
        raise RolloutFailure(result.error)
    return result


class EngineRolloutWorker(RolloutWorker):
    """A `RolloutWorker` over an in-process `GenerationEngine` (see the module docstring).

    Several groups may be in flight at once: they share the engine's continuous batch. `set_weights`
    may come while they are: it waits for them (`loads_between_requests`). A call for the version being
    loaded (or for a newer one not announced yet) waits until it is loaded and checked, so the
    controller sends the next requests with the new weights instead of after them; a call for an older
    version fails (`RolloutFailure`, retried). After a failed load or generation step every call fails
    with `WorkerLostError` (the controller retires the worker). The `*_blocking` methods serve a caller
    that runs one call at a time, in order (the Ray actor)."""

    batches_groups = True
    loads_between_requests = True

    def __init__(
        self, cfg: RolloutWorkerConfig, engine: GenerationEngine, task: Task | EnvSuite, name: str = ""
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.task = task
        self.name = name or "engine-worker"
        self._pad_id = pad_token_id(engine.tokenizer)
        probe = cfg.weight_sync.probe.enabled
        self._sync = probe_sync(cfg.weight_sync, engine.vocab_size, cfg.dp_size) if probe else None
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
    def build(cls, cfg: RolloutWorkerConfig, name: str = "") -> EngineRolloutWorker:
        """Tokenizer, task (for its reward) and an engine of the policy's model; the weights it starts
        with are replaced by the first `set_weights`."""
        tokenizer = build_tokenizer(cfg.model)
        reward = cfg.task.reward
        if reward.on_reward_error == "skip_sample":  # the trainer side checks the fraction per step
            reward = reward.model_copy(update={"max_failed_fraction": 1.0})
        if cfg.env is not None:
            task: Task | EnvSuite = build_env(cfg.env)
        else:
            task = build_task(cfg.task.model_copy(update={"reward": reward}), tokenizer)
        model = engine_model(cfg.model, cfg.lora, tokenizer)
        engine = GenerationEngine(model, tokenizer, engine_config(cfg.generation, cfg.sampling, task))
        return cls(cfg, engine, task, name)

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
        if isinstance(self.task, EnvSuite):
            return await self._play_scored(prompts, weight_version)
        g = self.cfg.group.num_generations_per_prompt
        generated = await asyncio.gather(*(self._generate(p, weight_version, g) for p in prompts))
        return await daemon_call(self._score_groups, prompts, generated, weight_version)

    async def _play_scored(self, prompts: list[PromptItem], weight_version: int) -> list[GroupResult]:
        """An environment's episodes: each group's trajectories played concurrently, the rewards the
        environment gave (failed trajectories NaN and flagged), rows laid out on a thread."""
        assert isinstance(self.task, EnvSuite)
        g, seed = self.cfg.group.num_generations_per_prompt, self.cfg.group.seed
        t0 = time.perf_counter()
        groups = await play_groups(
            self.engine,
            self.engine.tokenizer,
            self.task,
            prompts,
            g,
            self.cfg.sampling,
            lambda i: (group_seed(seed, prompts[i].prompt_id, weight_version, prompts[i].repeat), 0),
        )
        seconds = time.perf_counter() - t0
        out = []
        for prompt, trajs in zip(prompts, groups):
            rewards, failed, summary = trajectory_rewards(trajs)
            versions = {v for t in trajs for v in (turn.weight_version for turn in t.turns)}
            stamp = versions.pop() if len(versions) == 1 else (weight_version if not versions else -1)
            metrics = {**summary, "generation_s": seconds, **self._sync_metrics}
            samples = GroupSamples(prompt.prompt_id, trajs, rewards.tolist(), failed.tolist(), metrics)
            out.append(GroupResult(samples, stamp, g))
        await daemon_call(attach_rows, [r.samples for r in out], self.cfg.group, self._pad_id)
        return out

    def _requests(self, prompt: PromptItem, weight_version: int) -> tuple[list[int], Any]:
        """A group's prompt and sampling parameters: its G requests share them, with the group's seed
        (request k draws from stream k of it)."""
        seed = group_seed(self.cfg.group.seed, prompt.prompt_id, weight_version, prompt.repeat)
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
        g, max_new = self.cfg.group.num_generations_per_prompt, self.cfg.sampling.max_new_tokens
        out = []
        for prompt, (results, seconds) in zip(prompts, generated):
            t0 = time.perf_counter()
            try:
                rewards, failed, summary = score(
                    self.task, self.engine.tokenizer, [prompt], results, self.cfg.group, max_new
                )
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
        attach_rows([r.samples for r in out if r.error is None], self.cfg.group, self._pad_id)
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
            await daemon_call(self._check_loaded, weights, version, seconds)
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
        if isinstance(self.task, EnvSuite):  # episodes await their environments: an event loop here
            return self._blocking_episodes(prompts, weight_version)
        g = self.cfg.group.num_generations_per_prompt
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

    def _blocking_episodes(self, prompts: list[PromptItem], weight_version: int) -> list[GroupResult]:
        try:
            return asyncio.run(self._play_scored(prompts, weight_version))
        except BaseException as e:  # its requests may be left in the engine: no later call can trust it
            self._mark_broken("an episode's generation failed", e)
            raise

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


def start_local_workers(cfg: RolloutWorkerConfig, num_workers: int) -> list[EngineRolloutWorker]:
    """`num_workers` engines in this process."""
    return [EngineRolloutWorker.build(cfg, f"rollout-{i}") for i in range(num_workers)]
