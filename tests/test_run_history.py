"""One run, one history: resumes keep each step once in metrics.jsonl, `resume=never` over a run needs
consent and then deletes it, a refused resume leaves the run's files as they were, a new learning rate
on resume applies, and Ctrl-C stops at a step boundary with a checkpoint that resumes (sync GRPO in a
subprocess with a real SIGINT, grpo-async and SFT in-process)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import small_async_grpo_cfg, small_grpo_cfg, subprocess_env
from posttrain.algorithms import grpo as grpo_module
from posttrain.algorithms import sft as sft_module
from posttrain.algorithms.async_grpo.run import run_async_grpo
from posttrain.algorithms.grpo import run_grpo
from posttrain.algorithms.runs import RunInterrupted
from posttrain.cli import main as cli_main
from posttrain.config import dump_config
from posttrain.logging import read_metrics, trim_metrics
from posttrain.policy.config import SchedulerStage
from posttrain.policy.optim import build_optimizer, build_scheduler, set_base_lr


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _steps(out: Path, key: str = "train/loss") -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if key in r]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def _logged_a_step(out: Path) -> bool:
    """Whether a running process has logged a training step (a line being written does not count)."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return any('"train/loss"' in line and line.endswith("}") for line in lines)


def _kill_before_save(out: Path, step: int) -> None:
    """What a kill -9 between a step's metrics row and its checkpoint leaves: the row, no checkpoint."""
    import shutil

    shutil.rmtree(out / "checkpoints" / f"step_{step}")


# --------------------------------------------------------------------------- metrics.jsonl


def test_trim_metrics_keeps_rows_up_to_the_step_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "x": s} for s in (0, 1, 2, 3, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "x"')
    assert trim_metrics(path, 2) == 2  # step 3 and the torn line
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 2]
    assert trim_metrics(path, 2) == 0 and not (tmp_path / "metrics.jsonl.tmp").exists()


def test_resuming_twice_keeps_each_step_once(tmp_path):
    out = tmp_path / "run"
    run_grpo(small_grpo_cfg(out, "grpo.max_num_steps=3"))  # checkpoints 2 and 3 (the last step)
    _kill_before_save(out, 3)
    run_grpo(small_grpo_cfg(out))  # resumes from 2: steps 3 and 4 (checkpoint 4)
    _kill_before_save(out, 4)
    run_grpo(small_grpo_cfg(out))  # resumes from 2 again
    assert _steps(out) == [1, 2, 3, 4]
    assert _steps(out, "val/accuracy") == [0, 2, 4]
    assert _checkpoints(out) == ["step_2", "step_4"]


def test_rerunning_a_finished_run_trains_nothing_and_reports_its_last_step(tmp_path, capsys):
    cfg = small_grpo_cfg(tmp_path / "run", "grpo.max_num_steps=2")
    first = run_grpo(cfg)
    before = _snapshot(tmp_path / "run" / "checkpoints")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    (tmp_path / "cfg.yaml").write_text(dump_config(cfg))
    assert cli_main(["grpo", "--config", str(tmp_path / "cfg.yaml")]) == 0
    printed = capsys.readouterr().out
    assert f"reward {first['reward']:.3f}" in printed and "nan" not in printed, printed
    assert f"held-out accuracy {first['val/accuracy']:.3f}" in printed
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == rows
    assert _snapshot(tmp_path / "run" / "checkpoints") == before


# --------------------------------------------------------------------------- resume=never, refusals


def test_resume_never_needs_consent_and_then_deletes_the_old_run(tmp_path, capsys):
    out = tmp_path / "run"
    run_grpo(small_grpo_cfg(out))  # checkpoints 2 and 4
    before = _snapshot(out)
    with pytest.raises(ValueError, match=r"--overwrite \(or set checkpointing.overwrite=true\)"):
        run_grpo(small_grpo_cfg(out, "checkpointing.resume=never", "grpo.seed=1"))
    with pytest.raises(ValueError, match=r"grpo.seed: checkpoint 0, now 1(.|\n)*--overwrite"):
        run_grpo(small_grpo_cfg(out, "grpo.seed=1"))  # a refused resume
    assert _snapshot(out) == before  # config.yaml included

    new = small_grpo_cfg(out, "grpo.max_num_steps=2", "grpo.seed=1")
    (tmp_path / "new.yaml").write_text(dump_config(new))
    assert cli_main(["grpo", "--config", str(tmp_path / "new.yaml"), "--overwrite"]) == 0
    assert _checkpoints(out) == ["step_2"]  # the old run's step_4 is gone
    assert _steps(out) == [1, 2]
    assert "seed: 1" in (out / "config.yaml").read_text()
    row_2 = read_metrics(out / "metrics.jsonl")[2]
    run_grpo(small_grpo_cfg(out, "grpo.max_num_steps=3", "grpo.seed=1"))  # auto: the new run's step_2
    assert _steps(out) == [1, 2, 3] and read_metrics(out / "metrics.jsonl")[2] == row_2
    extra = json.loads((out / "checkpoints" / "step_3" / "extra_state.json").read_text())
    assert extra["config"]["grpo"]["seed"] == 1


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_runs_without_checkpoints_refuse_an_output_dir_that_holds_a_run_unless_overwrite(
    tmp_path, command, capsys
):
    """SFT, DPO and reward-model runs keep one run per output directory too: a second run there is
    refused (nothing touched) unless --overwrite, which deletes the previous run first."""
    from posttrain.cli import config_class

    out = tmp_path / "run"
    small = {"model": {"tiny": {"hidden_size": 32, "intermediate_size": 64}}}
    small |= {"train_global_batch_size": 8, "microbatch": {"train_micro_batch_size": 8}}
    fields = {"policy": small, "max_num_steps": 1, "val_period": 0, "output_dir": str(out)}
    cfg = config_class(command).model_validate(fields | {"logging": {"progress_bar": False}})
    (tmp_path / "cfg.yaml").write_text(dump_config(cfg))
    argv = [command, "--config", str(tmp_path / "cfg.yaml")]
    assert cli_main(argv) == 0
    (out / "hf" / "left_by_the_first_run").write_text("")
    before = _snapshot(out)
    capsys.readouterr()
    assert cli_main(argv + ["seed=1"]) == 1
    printed = " ".join("".join(capsys.readouterr()).split())
    assert (
        f"already holds a run (metrics.jsonl, config.yaml, hf); a new {command} run would replace it"
        in printed
    )
    assert "pass --overwrite (or set overwrite=true)" in printed
    assert _snapshot(out) == before
    assert cli_main(argv + ["seed=1", "--overwrite"]) == 0
    assert "seed: 1" in (out / "config.yaml").read_text()
    assert not (out / "hf" / "left_by_the_first_run").exists() and (out / "hf" / "config.json").is_file()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r] == [1]


# --------------------------------------------------------------------------- a new learning rate


def test_a_new_lr_on_resume_applies_and_is_logged(tmp_path, caplog):
    out = tmp_path / "run"
    run_grpo(small_grpo_cfg(out, "grpo.max_num_steps=2"))
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        run_grpo(small_grpo_cfg(out, "grpo.max_num_steps=3", "policy.optimizer.lr=3e-3"))
    assert "resuming with policy.optimizer.lr changed 0.001 -> 0.003" in caplog.text
    assert "resuming with grpo.max_num_steps changed 2 -> 3" in caplog.text
    lrs = [r["train/lr"] for r in read_metrics(out / "metrics.jsonl") if "train/lr" in r]
    assert lrs == [1e-3, 1e-3, 3e-3]
    with pytest.raises(ValueError, match=r"policy.scheduler: checkpoint \[\], now"):
        run_grpo(small_grpo_cfg(out, "grpo.max_num_steps=4", "policy.scheduler=[{kind: linear, steps: 8}]"))


def test_set_base_lr_keeps_the_schedules_position():
    stages = [
        SchedulerStage(kind="linear", steps=4, start_factor=0.25),
        SchedulerStage(kind="cosine", steps=8, min_factor=0.1),
    ]

    def build(lr: float):
        from posttrain.policy.config import OptimizerConfig

        opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimizerConfig(lr=lr))
        return opt, build_scheduler(opt, stages)

    def run(opt, sched, n: int) -> list[float]:
        out = []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    ref_opt, ref_sched = build(3e-3)
    reference = run(ref_opt, ref_sched, 10)
    old_opt, old_sched = build(1e-3)
    run(old_opt, old_sched, 6)
    opt, sched = build(1e-3)  # a run with the old lr, loaded from the checkpoint, then given the new one
    opt.load_state_dict(old_opt.state_dict())
    sched.load_state_dict(old_sched.state_dict())
    assert set_base_lr(opt, sched, 3e-3) == 1e-3
    torch.testing.assert_close(run(opt, sched, 4), reference[6:])
    assert set_base_lr(opt, sched, 3e-3) is None


# --------------------------------------------------------------------------- Ctrl-C


def _sigint_at(step: int):
    def send(current: int) -> None:
        if current == step:
            os.kill(os.getpid(), signal.SIGINT)

    return send


def test_sigint_stops_a_sync_run_with_a_checkpoint_it_resumes_from(tmp_path):
    """A real Ctrl-C: SIGINT to a `posttrain grpo` process once it logged a step."""
    out = tmp_path / "run"
    cfg = small_grpo_cfg(out, "grpo.max_num_steps=500", "checkpointing.save_period=1000", "grpo.val_period=0")
    (tmp_path / "cfg.yaml").write_text(dump_config(cfg))
    env = subprocess_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "posttrain.cli", "grpo", "--config", str(tmp_path / "cfg.yaml")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _logged_a_step(out):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    step = _steps(out)[-1]
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr + stdout, stderr
    assert f"grpo interrupted at step {step} of 500" in " ".join(stdout.split()), stdout
    assert "step_" + str(step) in stdout.replace("\n", "") and "run the same command again" in stdout
    assert _checkpoints(out) == [f"step_{step}"] and 1 <= step < 500
    run_grpo(small_grpo_cfg(out, f"grpo.max_num_steps={step + 1}", "checkpointing.save_period=1000"))
    assert _steps(out) == list(range(1, step + 2))


def test_sigint_stops_an_async_run_with_a_checkpoint_it_resumes_from(tmp_path):
    out = tmp_path / "run"
    send = _sigint_at(1)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs in a background job
    with pytest.raises(RunInterrupted) as stopped:
        run_async_grpo(small_async_grpo_cfg(out), hook=lambda run, step, metrics: send(step))
    assert stopped.value.step == 1 and stopped.value.checkpoint == out.absolute() / "checkpoints" / "step_1"
    assert f"grpo-async interrupted at step 1 of 4: checkpoint saved: {stopped.value.checkpoint}" in str(
        stopped.value
    )
    extra = json.loads((out / "checkpoints" / "step_1" / "extra_state.json").read_text())
    assert extra["step"] == 1 and extra["controller"]["trainer_version"] == 1
    assert signal.getsignal(signal.SIGINT) is before  # handler restored
    last = run_async_grpo(small_async_grpo_cfg(out, "async_grpo.num_steps=2"))
    assert last["summary/steps"] == 2 and _steps(out) == [1, 2]


def test_the_checkpoint_of_a_sync_stop_holds_the_stopped_steps_own_metrics(tmp_path):
    """Ctrl-C at step 3 (val_period 2): the stop's checkpoint records step 3's metrics, not step 2's
    validation, so keep_top_k by val/accuracy does not rank step 3 by a value it never measured."""
    step_fn, send = grpo_module.grpo_step, _sigint_at(3)

    def step_then_sigint(run):
        metrics = step_fn(run)
        send(run.step)
        return metrics

    out = tmp_path / "run"
    cfg = small_grpo_cfg(
        out,
        "grpo.max_num_steps=6",
        "grpo.val_at_start=false",
        "checkpointing.keep_top_k=2",
        "checkpointing.metric_name=val/accuracy",
    )  # val_period 2, save_period 2
    with pytest.raises(RunInterrupted, match="interrupted at step 3 of 6"):
        run_grpo(cfg, step_fn=step_then_sigint)
    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert "val/accuracy" in rows[2] and "val/accuracy" not in rows[3]
    saved = json.loads((out / "checkpoints" / "step_3" / "extra_state.json").read_text())["metrics"]
    assert "val/accuracy" not in saved and saved["reward"] == rows[3]["reward"]


def test_sigint_in_sync_grpo_and_sft_in_process(tmp_path, monkeypatch, capsys):
    """The CLI's exit code and line for a sync run (signal from inside a step), and SFT, which says
    that nothing is saved."""
    step_fn, send = grpo_module.grpo_step, _sigint_at(3)

    def step_then_sigint(run):
        metrics = step_fn(run)
        send(run.step)
        return metrics

    monkeypatch.setattr(grpo_module, "grpo_step", step_then_sigint)
    cfg = small_grpo_cfg(tmp_path / "grpo")  # save_period 2: step 3 is saved because of the stop
    (tmp_path / "cfg.yaml").write_text(dump_config(cfg))
    assert cli_main(["grpo", "--config", str(tmp_path / "cfg.yaml")]) == 130
    printed = " ".join(capsys.readouterr().out.split())
    assert "stopped: grpo interrupted at step 3 of 4: checkpoint saved:" in printed, printed
    assert _checkpoints(tmp_path / "grpo") == ["step_2", "step_3"]

    batches, send = sft_module.example_batches, _sigint_at(2)

    def batches_then_sigint(*args):
        for i, batch in enumerate(batches(*args), start=1):
            send(i)
            yield batch

    monkeypatch.setattr(sft_module, "example_batches", batches_then_sigint)
    sft = sft_module.SFTConfig.model_validate(
        {
            "policy": {"model": {"tiny": {"hidden_size": 32, "intermediate_size": 64}}},
            "max_num_steps": 5,
            "logging": {"progress_bar": False},
            "output_dir": str(tmp_path / "sft"),
        }
    )
    with pytest.raises(RunInterrupted, match="sft interrupted at step 2 of 5: .* nothing was saved"):
        sft_module.run_sft(sft)
    assert [r["step"] for r in read_metrics(tmp_path / "sft" / "metrics.jsonl")] == [1, 2]
    assert not (tmp_path / "sft" / "hf").exists()
