"""The metrics log's sinks besides metrics.jsonl: TensorBoard and W&B, through stand-ins for their
packages (neither is needed to run the suite). A fresh run starts their history afresh, a resumed run
continues it without repeating a step, a run ended by an error is marked failed, a missing package is
refused when the config loads, numbers of any array type reach every sink, and SFT logs its last held-out
loss once."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import small_grpo_cfg, stand_in
from posttrain.algorithms import grpo as grpo_module
from posttrain.algorithms import sft as sft_module
from posttrain.algorithms.grpo import run_grpo
from posttrain.algorithms.runs import open_metrics
from posttrain.config import ConfigError, load_config
from posttrain.logging import LoggingConfig, MetricsLogger, read_metrics


class FakeWandb(types.ModuleType):
    """Records what a run sends to W&B: ("init", kwargs), ("log", step, keys), ("finish", exit_code)."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.calls: list[tuple] = []
        self.init_error: Exception | None = None

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        if self.init_error is not None:
            raise self.init_error
        calls = self.calls

        class Run:
            def log(self, data, step=None):
                calls.append(("log", step, sorted(data)))

            def finish(self, exit_code=None):
                calls.append(("finish", exit_code))

        return Run()

    def of(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


class FakeWriter:
    """A SummaryWriter that keeps its scalars and makes its directory, as the real one does."""

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.purge_step = purge_step
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        pass


@pytest.fixture
def wandb(monkeypatch) -> FakeWandb:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


@pytest.fixture
def writers(monkeypatch) -> list[FakeWriter]:
    made: list[FakeWriter] = []

    def summary_writer(log_dir, purge_step=None):
        made.append(FakeWriter(log_dir, purge_step))
        return made[-1]

    module = stand_in("torch.utils.tensorboard")
    module.SummaryWriter = summary_writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    monkeypatch.setitem(sys.modules, "tensorboard", stand_in("tensorboard"))
    return made


# --------------------------------------------------------------------------- TensorBoard


def test_a_fresh_run_removes_the_event_files_an_earlier_run_left(tmp_path, writers):
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "events.out.tfevents.1.host.1.0").write_text("old run")
    (tb / "notes.txt").write_text("not ours")
    MetricsLogger(tmp_path, tensorboard=True).close()
    assert sorted(p.name for p in tb.iterdir()) == ["notes.txt"]
    assert writers[-1].purge_step is None

    (tb / "events.out.tfevents.2.host.1.0").write_text("this run")
    MetricsLogger(tmp_path, tensorboard=True, resume_step=2).close()  # a resume keeps them, purges after 2
    assert (tb / "events.out.tfevents.2.host.1.0").is_file() and writers[-1].purge_step == 3


def test_numpy_and_torch_numbers_reach_every_sink_as_numbers(tmp_path, writers, wandb):
    metrics = {
        "f32": np.float32(0.5),
        "i64": np.int64(3),
        "array0d": np.array(1.5),
        "array1": np.array([2.0]),
        "tensor0d": torch.tensor(2.5),
        "tensor1": torch.tensor([4]),
        "vector": np.array([1.0, 2.0]),
    }
    logger = MetricsLogger(tmp_path, tensorboard=True, wandb_project="p")
    logger.log(metrics, 1)
    logger.close()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    numbers = {"f32": 0.5, "i64": 3, "array0d": 1.5, "array1": 2.0, "tensor0d": 2.5, "tensor1": 4}
    assert {k: row[k] for k in numbers} == numbers
    assert all(type(row[k]) in (int, float) for k in numbers)
    assert {(tag, value) for tag, value, _ in writers[-1].scalars} == set(numbers.items())
    assert wandb.of("log") == [("log", 1, sorted(numbers))]


# --------------------------------------------------------------------------- W&B


def test_a_resumed_run_continues_its_wandb_run_and_sends_no_step_twice(tmp_path, wandb):
    logger = MetricsLogger(tmp_path / "run", wandb_project="p")
    for step in (1, 2, 3):
        logger.log({"x": step}, step)
    logger.close()
    logger = MetricsLogger(tmp_path / "run", wandb_project="p", run_name="mine", resume_step=2)
    for step in (2, 3, 4):  # step 2 again: the resumed step's row, logged again by some loop
        logger.log({"x": step}, step)
    logger.close()
    first, second = (kwargs for _, kwargs in wandb.of("init"))
    run_id = (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert first["id"] == second["id"] == run_id and first["resume"] == second["resume"] == "allow"
    assert (first["name"], second["name"]) == ("run", "mine")
    assert [c[1] for c in wandb.of("log")] == [1, 2, 3, 3, 4]

    MetricsLogger(tmp_path / "run", wandb_project="p").close()  # a fresh run in that directory: a new run
    assert wandb.of("init")[-1][1]["id"] != run_id


def test_the_run_name_comes_from_the_logging_config(tmp_path, wandb):
    open_metrics(tmp_path, LoggingConfig(wandb_project="p", wandb_run_name="lr-3e-4"), None).close()
    assert wandb.of("init")[0][1]["name"] == "lr-3e-4"


def test_a_crashed_grpo_run_is_marked_failed_and_its_resume_continues_the_same_wandb_run(tmp_path, wandb):
    def crash_at_3(run):
        if run.step == 3:
            raise RuntimeError("out of memory (simulated)")
        return grpo_module.grpo_step(run)

    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated"):
        run_grpo(small_grpo_cfg(out, "logging.wandb_project=p"), step_fn=crash_at_3)
    assert wandb.of("finish") == [("finish", 1)]
    run_grpo(small_grpo_cfg(out, "logging.wandb_project=p"))  # resumes from step_2
    assert wandb.of("finish") == [("finish", 1), ("finish", None)]
    first, second = (kwargs for _, kwargs in wandb.of("init"))
    assert first["id"] == second["id"] and second["resume"] == "allow" and first["name"] == "run"
    resumed = wandb.calls[[c[0] for c in wandb.calls].index("finish") + 1 :]
    assert [c[1] for c in resumed if c[0] == "log"] == [3, 4]


def test_a_failed_sft_run_is_marked_failed(tmp_path, wandb, monkeypatch):
    def broken_eval(*args):
        raise RuntimeError("eval failed (simulated)")

    monkeypatch.setattr(sft_module, "eval_loss", broken_eval)
    cfg = load_config(sft_module.SFTConfig, None, [f"output_dir={tmp_path}", "logging.wandb_project=p", *SFT])
    with pytest.raises(RuntimeError, match="simulated"):
        sft_module.run_sft(cfg)
    assert wandb.of("finish") == [("finish", 1)]


# --------------------------------------------------------------------------- a sink that cannot start


def test_a_missing_sink_package_is_refused_when_the_config_loads(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.delitem(sys.modules, "tensorboard", raising=False)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("wandb", "tensorboard") else find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"pip install wandb, or set logging.wandb_project=null"):
        load_config(grpo_module.GRPOConfig, None, ["logging.wandb_project=p"])
    with pytest.raises(ConfigError, match=r"pip install tensorboard, or set logging.tensorboard=false"):
        load_config(grpo_module.GRPOConfig, None, ["logging.tensorboard=true"])
    load_config(grpo_module.GRPOConfig, None, ["logging.wandb_project=null"])


def test_a_sink_that_cannot_start_leaves_the_metrics_log_and_shuts_the_reward_model_down(
    tmp_path, wandb, monkeypatch
):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    wandb.init_error = RuntimeError("wandb login needed (simulated)")
    with pytest.raises(RuntimeError, match="simulated"):
        MetricsLogger(tmp_path, wandb_project="p", resume_step=1)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]  # not trimmed yet

    shut_down = []
    setup = grpo_module.setup

    def setup_with_reward_model(*args):
        run = setup(*args)
        run.reward_model = types.SimpleNamespace(shutdown=lambda: shut_down.append(True))
        return run

    monkeypatch.setattr(grpo_module, "setup", setup_with_reward_model)
    with pytest.raises(RuntimeError, match="simulated"):
        run_grpo(small_grpo_cfg(tmp_path / "run", "logging.wandb_project=p"))
    assert shut_down == [True] and not (tmp_path / "run" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- SFT's last held-out loss

SFT = [
    "policy.model.tiny.hidden_size=32",
    "policy.model.tiny.intermediate_size=64",
    "policy.train_global_batch_size=16",
    "policy.microbatch.train_micro_batch_size=16",
    "policy.init_reference_model=false",
    "save_final_model=false",
    "logging.progress_bar=false",
]


@pytest.mark.parametrize(("val_period", "validated"), [(2, [2, 4]), (3, [3, 4])])
def test_sft_logs_the_last_held_out_loss_once(tmp_path, monkeypatch, val_period, validated):
    calls = []
    eval_loss = sft_module.eval_loss
    monkeypatch.setattr(sft_module, "eval_loss", lambda *a: calls.append(1) or eval_loss(*a))
    cfg = load_config(
        sft_module.SFTConfig,
        None,
        [f"output_dir={tmp_path}", "max_num_steps=4", f"val_period={val_period}", *SFT],
    )
    last = sft_module.run_sft(cfg)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "val/loss" in r]
    assert [r["step"] for r in rows] == validated and len(calls) == len(validated)
    assert last["val_loss"] == rows[-1]["val/loss"]
