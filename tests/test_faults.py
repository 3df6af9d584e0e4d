"""Faults in checkpointing, end to end on the tiny synchronous GRPO run (CPU).

kill -9 at every stage of a save (checkpoint_verify.STAGES, through its POSTTRAIN_CHECKPOINT_FAULT
hook; one run per stage, forked side by side from one fresh interpreter), and a damaged checkpoint
(garbage JSON, 4 KB of 0xFF in the weights, a truncated shard): `checkpointing.resume=auto` then
resumes from the right checkpoint, cleaning up what the kill left and skipping what is damaged with
the reason logged, and the run ends with the very weights of an uninterrupted run.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from helpers import small_async_grpo_cfg, small_grpo_cfg, subprocess_env
from posttrain import checkpoint
from posttrain.algorithms.async_grpo import run as async_run
from posttrain.algorithms.async_grpo.ledger import BufferedGroup
from posttrain.algorithms.checkpointing import CheckpointingConfig, CheckpointManager
from posttrain.algorithms.grpo import run_grpo
from posttrain.checkpoint_verify import FAULT_ENV, CorruptCheckpointError
from posttrain.logging import read_metrics
from posttrain.rollout.rows import SAMPLES_CODEC

STEPS = 6  # the uninterrupted run; killed runs stop in their save of step_4 (save_period 2)
RESUMED_FROM = {"start": 2, "shards": 2, "metadata": 2, "committed": 4, "aside": 2}


def ckpt_dir(out: Path) -> Path:
    return out / "checkpoints"


def copy_checkpoints(reference: Path, out: Path, steps=(2, 4)) -> Path:
    for step in steps:
        shutil.copytree(ckpt_dir(reference) / f"step_{step}", ckpt_dir(out) / f"step_{step}")
    return out


def shard(path: Path) -> Path:
    (found,) = (path / "state").glob("*model*.safetensors")
    return found


def spoil_weights(path: Path) -> None:
    """4 KB of 0xFF in the middle of the model's shard (same size: only a checksum can tell)."""
    f = shard(path)
    data = bytearray(f.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = b"\xff" * 4096
    f.write_bytes(bytes(data))


def resume_to_end(out: Path, caplog) -> int:
    """Run `resume=auto` to STEPS; the step it resumed from (from its log line)."""
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain"):
        run_grpo(small_grpo_cfg(out, f"grpo.max_num_steps={STEPS}"))
    resumed = re.findall(r"resumed from \S*step_(\d+)", caplog.text)
    assert len(resumed) == 1, caplog.text
    return int(resumed[0])


def assert_same_final_weights(out: Path, reference: Path) -> None:
    got = checkpoint.read_model_tensors(ckpt_dir(out) / f"step_{STEPS}")
    want = checkpoint.read_model_tensors(ckpt_dir(reference) / f"step_{STEPS}")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "the resumed run trained differently"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    run_grpo(small_grpo_cfg(out, f"grpo.max_num_steps={STEPS}"))
    return out


def run_killed(out: Path, stage: str) -> None:
    """The tiny GRPO run to step 4 in `out`, SIGKILLed at `stage` of its save of step_4. For `aside` it
    first runs to step 4 and damages step_4, so that the killed run resumes from step_2 and replaces it."""
    if stage == "aside":
        run_grpo(small_grpo_cfg(out, "grpo.max_num_steps=4"))
        spoil_weights(ckpt_dir(out) / "step_4")
    os.environ[FAULT_ENV] = f"{stage}:step_4"
    run_grpo(small_grpo_cfg(out, "grpo.max_num_steps=4"))


def fork_each(runs: dict[str, str], target) -> None:
    """In a fresh interpreter: fork one `target(Path(out), name)` per run, side by side (one import for
    all); print {name: exit code}."""
    torch.set_num_threads(1)  # as conftest.py: the same arithmetic as the test process
    pids = {}
    for name, out in runs.items():
        pid = os.fork()
        if pid == 0:
            try:
                target(Path(out), name)
            except BaseException:
                traceback.print_exc()
            os._exit(1)  # reached only when the kill did not happen
        pids[name] = pid
    print(json.dumps({name: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for name, pid in pids.items()}))


def kill_runs(runs: dict[str, str]) -> None:
    fork_each(runs, run_killed)


KILLER = "import sys; sys.path.insert(0, {tests!r}); from test_faults import {fn}; {fn}({runs!r})"


def run_killers(tmp_path_factory, runs: dict[str, Path], fn: str, meanwhile=None) -> None:
    """`fn(runs)` (a `fork_each`) in a fresh interpreter; every run must have died of SIGKILL.
    `meanwhile()` runs here in the meantime."""
    code = KILLER.format(tests=str(Path(__file__).parent), fn=fn, runs={k: str(v) for k, v in runs.items()})
    env = subprocess_env()  # this checkout's package, also in the child
    log = tmp_path_factory.mktemp("killer") / "stderr.log"
    with open(log, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=stderr)
    if meanwhile is not None:
        meanwhile()
    stdout, _ = child.communicate(timeout=300)
    assert child.returncode == 0, log.read_text()[-5000:]
    exits = json.loads(stdout.decode().strip().splitlines()[-1])
    not_killed = {name: rc for name, rc in exits.items() if rc != -signal.SIGKILL}
    assert not not_killed, (
        f"runs not killed where planned (exit codes): {not_killed}\n{log.read_text()[-5000:]}"
    )


@pytest.fixture(scope="module")
def killed(tmp_path_factory, request) -> dict[str, Path]:
    """One run per stage in its own directory, each SIGKILLed in its save of step_4 (beside the
    reference run, which is computed meanwhile)."""
    runs = {stage: tmp_path_factory.mktemp(stage) for stage in RESUMED_FROM}
    run_killers(tmp_path_factory, runs, "kill_runs", lambda: request.getfixturevalue("reference"))
    return runs


def leftovers(out: Path) -> list[str]:
    return sorted(p.name.split("-")[0] for p in ckpt_dir(out).iterdir() if "-" in p.name)


@pytest.mark.parametrize("stage", list(RESUMED_FROM))
def test_kill_at_every_stage_of_a_save_then_resume(stage, killed, reference, caplog):
    out = killed[stage]
    expected_leftovers = {
        "start": [],
        "shards": ["step_4.tmp"],
        "metadata": ["step_4.tmp"],  # complete, metadata.json included: the crash of issue 21
        "committed": [],
        "aside": ["step_4.old", "step_4.tmp"],
    }[stage]
    assert leftovers(out) == expected_leftovers
    if stage == "metadata":
        (tmp,) = ckpt_dir(out).glob("step_4.tmp-*")
        assert (tmp / "metadata.json").is_file()

    assert resume_to_end(out, caplog) == RESUMED_FROM[stage]
    assert leftovers(out) == []
    for name in expected_leftovers:
        if name.endswith(".old"):  # the replaced checkpoint moved back, then found damaged and skipped
            assert re.search(rf"moved \S*{name}-\w+ back to \S*step_4", caplog.text)
            assert re.search(r"skipping checkpoint \S*step_4: .*contents changed", caplog.text)
        else:
            assert re.search(rf"removed \S*{name}-\w+, left by an interrupted save", caplog.text)
    assert_same_final_weights(out, reference)


def spoil_json(path: Path) -> str:
    (path / "extra_state.json").write_text("{garbage")
    return r"extra_state\.json: \d+ bytes, saved with \d+"


def spoil_weights_same_size(path: Path) -> str:
    spoil_weights(path)
    return rf"{shard(path).relative_to(path)}: contents changed since the save \(sha256 differs\)"


def truncate_shard(path: Path) -> str:
    f = shard(path)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    return rf"{shard(path).relative_to(path)}: \d+ bytes, saved with \d+ \(truncated or overwritten\)"


@pytest.mark.parametrize("spoil", [spoil_json, spoil_weights_same_size, truncate_shard])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(spoil, tmp_path, reference, caplog):
    out = copy_checkpoints(reference, tmp_path)
    reason = spoil(ckpt_dir(out) / "step_4")
    assert resume_to_end(out, caplog) == 2
    assert re.search(rf"skipping checkpoint \S*step_4: .*{reason}", caplog.text), caplog.text
    assert_same_final_weights(out, reference)


def test_loading_a_damaged_checkpoint_names_the_file(tmp_path, reference):
    from posttrain.policy.policy import Policy

    path = copy_checkpoints(reference, tmp_path, steps=(4,)) / "checkpoints" / "step_4"
    spoil_weights(path)
    policy = Policy(small_grpo_cfg(tmp_path).policy)
    with pytest.raises(CorruptCheckpointError, match=r"step_4' is damaged: state/\S+model\S+: contents"):
        policy.load_checkpoint(path)
    with pytest.raises(CorruptCheckpointError, match="contents changed"):
        checkpoint.read_model_tensors(path)  # what `posttrain export` reads

    # a checkpoint saved before checksums: garbage JSON is still reported with the file's path
    meta = json.loads((path / "metadata.json").read_text())
    del meta["files"]
    (path / "metadata.json").write_text(json.dumps(meta))
    (path / "train_state.json").write_text("\x00" * 64)
    with pytest.raises(CorruptCheckpointError, match=r"train_state\.json' is damaged: not valid JSON"):
        policy.load_checkpoint(path)
    (path / "metadata.json").write_text("{")
    with pytest.raises(CorruptCheckpointError, match=r"metadata\.json' is damaged: not valid JSON"):
        policy.load_checkpoint(path)
    policy.shutdown()


def test_no_intact_checkpoint_is_an_error_naming_each(tmp_path, reference):
    out = copy_checkpoints(reference, tmp_path)
    spoil_json(ckpt_dir(out) / "step_2")
    truncate_shard(ckpt_dir(out) / "step_4")
    with pytest.raises(ValueError, match=r"no checkpoint in .* is intact:\n  step_4: .*\n  step_2: .*"):
        CheckpointManager(CheckpointingConfig(), out).resume_path()


def test_a_leftover_that_cannot_be_removed_is_named_with_the_command(tmp_path, monkeypatch, caplog):
    stuck = ckpt_dir(tmp_path) / "step_3.tmp-0123456789ab"
    stuck.mkdir(parents=True)
    (ckpt_dir(tmp_path) / "step_3.tmp-notes.txt").write_text("not ours")  # not a directory name we make
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)
    with caplog.at_level("WARNING", logger="posttrain"):
        assert CheckpointManager(CheckpointingConfig(), tmp_path).resume_path() is None
    assert (
        f"could not remove {stuck}, left by an interrupted save; remove it: rm -rf '{stuck}'" in caplog.text
    )
    assert "notes.txt" not in caplog.text


# --------------------------------------------------------------------------- grpo-async, kill -9

ASYNC_KILLS = ("mid_step", "after_step")  # in step 3 once two of its groups are in; after step 3


def group_digest(group: BufferedGroup) -> str:
    """A group's samples (token ids, logprobs, rewards; not their timings) as a short hash."""
    encoded = SAMPLES_CODEC.encode(group.samples)
    encoded.pop("metrics")
    return hashlib.sha256(json.dumps(encoded, sort_keys=True).encode()).hexdigest()[:16]


def record_groups(path: Path, kill_at: tuple[int, int] | None = None):
    """run.py's `prepare_samples`, appending every group it prepares to `path` as [trainer version,
    group id, prompt id, weight version, samples digest]; with `kill_at=(version, n)` the process is
    SIGKILLed once the n-th group at that trainer version is written."""
    original = async_run.prepare_samples

    def prepare_samples(cfg, trainer, stats):
        inner = original(cfg, trainer, stats)
        seen: collections.Counter = collections.Counter()

        async def prepare(group: BufferedGroup, version: int):
            row = [version, group.group_id, group.prompt_id, group.weight_version, group_digest(group)]
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            seen[version] += 1
            if kill_at == (version, seen[version]):
                os.kill(os.getpid(), signal.SIGKILL)
            return await inner(group, version)

        return prepare

    return prepare_samples


def step_groups(path: Path, step: int) -> list[list]:
    """The groups recorded for `step` (trained at trainer version step - 1), in training order."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [row[1:] for row in rows if row[0] == step - 1]


def run_async_killed(out: Path, kill: str) -> None:
    """The tiny grpo-async run (checkpoints at steps 2 and 4), SIGKILLed in or after its step 3."""
    async_run.prepare_samples = record_groups(out / "killed.jsonl", (2, 2) if kill == "mid_step" else None)

    def hook(run, step, metrics) -> None:
        if kill == "after_step" and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    async_run.run_async_grpo(small_async_grpo_cfg(out), hook=hook)


def kill_async_runs(runs: dict[str, str]) -> None:
    fork_each(runs, run_async_killed)


@pytest.fixture(scope="module")
def async_killed(tmp_path_factory) -> dict[str, Path]:
    runs = {kill: tmp_path_factory.mktemp(kill) for kill in ASYNC_KILLS}
    run_killers(tmp_path_factory, runs, "kill_async_runs")
    return runs


@pytest.mark.parametrize("kill", ASYNC_KILLS)
def test_a_killed_async_run_resumes_with_the_very_batch_it_was_training(kill, async_killed, monkeypatch):
    """kill -9 of a whole grpo-async run (policy, rollout engines, controller) in or after its step 3,
    then `resume=auto` from step_2: the resumed step 3 trains the same groups, drawn by the same weights,
    with the same samples, in the same order, as the killed run did; after a whole step, to the same
    loss. The checkpoint held every group that was in flight (finished, not redrawn) and sealed them."""
    out = async_killed[kill]
    killed = step_groups(out / "killed.jsonl", 3)
    assert len(killed) == (2 if kill == "mid_step" else 4)
    killed_step3 = [
        r for r in read_metrics(out / "metrics.jsonl") if r.get("step") == 3 and "train/loss" in r
    ]
    controller = json.loads((ckpt_dir(out) / "step_2" / "extra_state.json").read_text())["controller"]
    buffered = sorted(item["group_id"] for item in controller["buffer"])
    assert controller["requeue"] == [] and len(buffered) >= 4 and controller["sampler"]["sealed"] == buffered
    assert {gid for gid, *_ in killed} <= set(buffered)

    monkeypatch.setattr(async_run, "prepare_samples", record_groups(out / "resumed.jsonl"))
    last = async_run.run_async_grpo(small_async_grpo_cfg(out))
    assert last["summary/steps"] == 4
    resumed = step_groups(out / "resumed.jsonl", 3)
    assert resumed[: len(killed)] == killed and len(resumed) == 4
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    if kill == "after_step":
        (before,) = killed_step3
        for key in ("train/loss", "train/grad_norm", "reward"):
            assert rows[2][key] == before[key], key
