"""LoRA checkpoints and exports: a checkpoint holds the adapters and their optimizer state alone, resume
is exact (directly and through the GRPO loop's `resume=auto`), full and LoRA checkpoints refuse each
other, and `posttrain export` writes the merged model or a peft adapter directory that give the
trainer's logprobs. A base given by a relative path is recorded absolute, so export works from any
directory; a checkpoint that recorded it relative says so when its base cannot be loaded, and still
resumes from its run's directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import random_batch
from helpers import params_of, policy_cfg, small_grpo_cfg
from model_zoo import save_family_model
from posttrain import checkpoint
from posttrain.algorithms.grpo import run_grpo
from posttrain.algorithms.losses import NLLLoss
from posttrain.cli import main
from posttrain.logging import read_metrics
from posttrain.models.lora import is_adapter_key, peft_state_dict
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.policy import export, worker
from posttrain.policy.config import ModelConfig
from posttrain.policy.identity import BASE, base_weights
from posttrain.policy.model_init import build_tokenizer, load_full_model
from posttrain.policy.policy import Policy

SCHEDULE = [{"kind": "linear", "steps": 4, "start_factor": 0.3, "end_factor": 1.0}]
BATCHES = [random_batch(seed=i) for i in range(4)]
LORA = {"rank": 4, "alpha": 8.0}


def cfg(lora: dict | None = LORA, **overrides):
    return policy_cfg(scheduler=SCHEDULE, lora=lora, **overrides)


def train(policy: Policy, steps: range) -> list[float]:
    return [policy.train(BATCHES[i], NLLLoss())["loss"] for i in steps]


def state_tensors(ckpt) -> dict[str, list[int]]:
    """{DCP key: shape} of every tensor in a checkpoint's state/ files."""
    out = {}
    for f in (ckpt / "state").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as g:
            out |= {k: g.get_slice(k).get_shape() for k in g.keys()}
    return out


def state_bytes(ckpt) -> int:
    return sum(f.stat().st_size for f in (ckpt / "state").rglob("*") if f.is_file())


def adapter_names(policy: Policy) -> set[str]:
    return {n for n, _ in policy.group.workers[0].model.named_parameters() if is_adapter_key(n)}


def hf_logprobs(model, batch) -> torch.Tensor:
    """[B, T] logprobs of `batch` under a Hugging Face model, laid out like `get_logprobs` (position 0
    and padding: 0)."""
    ids = batch["input_ids"]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    valid = torch.arange(1, ids.shape[1])[None, :] < batch["input_lengths"][:, None]
    return torch.cat([torch.zeros(ids.shape[0], 1), lp * valid], dim=1)


def test_a_lora_checkpoint_holds_the_adapters_alone(tmp_path):
    lora, full = Policy(cfg()), Policy(cfg(lora=None))
    train(lora, range(1))
    train(full, range(1))
    lora.save_checkpoint(tmp_path / "lora")
    full.save_checkpoint(tmp_path / "full")

    adapters = adapter_names(lora)
    saved = state_tensors(tmp_path / "lora")
    assert {k.removeprefix("model.") for k in saved if k.startswith("model.")} == adapters
    optim = {k for k in saved if k.startswith("optim.")}
    assert optim == {f"optim.{n}.{s}" for n in adapters for s in ("exp_avg", "exp_avg_sq", "step")}
    assert set(saved) == {f"model.{n}" for n in adapters} | optim  # no base weights, no reference
    assert json.loads((tmp_path / "lora" / "metadata.json").read_text())["trainable_only"] is True
    lora_bytes, full_bytes = state_bytes(tmp_path / "lora"), state_bytes(tmp_path / "full")
    assert lora_bytes * 8 < full_bytes, (lora_bytes, full_bytes)


def test_lora_resume_is_exact(tmp_path):
    """Adapter dropout on, so the restored RNG matters too; another adapter init seed, so the adapters
    must come from the checkpoint."""
    first = Policy(cfg({**LORA, "dropout": 0.1}))
    train(first, range(1))
    first.save_checkpoint(tmp_path / "ckpt", extra_state={"step": 1})
    losses = train(first, range(1, 3))
    merged = params_of(first)
    ref_lp = first.get_reference_policy_logprobs(BATCHES[0])

    resumed = Policy(cfg({**LORA, "dropout": 0.1, "seed": 1}))
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"step": 1}
    assert resumed.get_states()[0]["trainer_version"] == 1
    assert train(resumed, range(1, 3)) == losses
    resumed_params = params_of(resumed)
    assert merged.keys() == resumed_params.keys()
    assert all(torch.equal(resumed_params[k], merged[k]) for k in merged)
    assert torch.equal(resumed.get_reference_policy_logprobs(BATCHES[0]), ref_lp)  # the base, untouched


def test_full_and_lora_checkpoints_refuse_each_other(tmp_path):
    full, lora = Policy(cfg(lora=None)), Policy(cfg())
    full.save_checkpoint(tmp_path / "full")
    lora.save_checkpoint(tmp_path / "lora")
    before = params_of(lora)

    with pytest.raises(ValueError, match="is a full fine-tuning checkpoint") as err:
        lora.load_checkpoint(tmp_path / "full")
    assert "unset policy.lora to resume it" in str(err.value)
    assert f"posttrain export {tmp_path / 'full'} <dir>" in str(err.value)  # or start LoRA from its export
    with pytest.raises(ValueError, match="holds LoRA adapters") as err:
        full.load_checkpoint(tmp_path / "lora")
    assert "set the same policy.lora to resume it" in str(err.value)
    assert "export it merged" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in params_of(lora).items())  # refused before any read

    wider = Policy(cfg({**LORA, "rank": 8}))
    with pytest.raises(ValueError, match="does not match") as err:
        wider.load_checkpoint(tmp_path / "lora")
    assert "lora.rank: checkpoint 4, current 8" in str(err.value)
    other_base = Policy(cfg(model={"seed": 1}))
    with pytest.raises(ValueError, match="model.seed: checkpoint 0, current 1"):
        other_base.load_checkpoint(tmp_path / "lora")


def test_a_replaced_base_is_refused_and_a_checkpoint_without_its_record_loads(tmp_path, monkeypatch):
    """A LoRA checkpoint records its base directory's weights: replaced by others of the same shape (an
    SFT run re-run into it), loading and the merged export are refused, naming the base and the fix; with
    the original weights back, both work. A checkpoint written before the record existed loads."""
    base = tmp_path / "base"

    def write_base(seed: int) -> None:
        shutil.rmtree(base, ignore_errors=True)
        p = Policy(cfg(lora=None, model={"seed": seed}))
        p.save_hf(str(base))
        p.shutdown()

    write_base(0)
    on_base = cfg(model={"name": str(base)})
    policy = Policy(on_base)
    train(policy, range(1))
    policy.save_checkpoint(tmp_path / "ckpt")
    identity = worker.checkpoint_identity
    with monkeypatch.context() as m:  # as written before the base was recorded
        m.setattr(worker, "checkpoint_identity", lambda *a, **k: without(identity(*a, **k), BASE))
        policy.save_checkpoint(tmp_path / "older")
    policy.shutdown()
    original = (base / "model.safetensors").read_bytes()

    write_base(1)
    other = Policy(on_base)
    with pytest.raises(ValueError, match="trained on other base weights") as err:
        other.load_checkpoint(tmp_path / "ckpt")
    assert f"policy.model.name={str(base)!r}" in str(err.value)
    assert "Point policy.model.name at the original base model" in str(err.value)
    with pytest.raises(ValueError, match="its weights were replaced"):
        export.export_hf(tmp_path / "ckpt", tmp_path / "out")
    other.load_checkpoint(tmp_path / "older")  # no record: unknown, not refused
    other.shutdown()

    (base / "model.safetensors").write_bytes(original)
    again = Policy(on_base)
    again.load_checkpoint(tmp_path / "ckpt")
    assert train(again, range(1, 2))
    again.shutdown()
    export.export_hf(tmp_path / "ckpt", tmp_path / "out")


def test_a_hub_base_is_identified_by_its_cached_revision(monkeypatch):
    import huggingface_hub

    snapshot = "/hf/hub/models--org--m/snapshots/0123abcd/config.json"
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda name, file: snapshot)
    assert base_weights(ModelConfig(name="org/m")) == "revision:0123abcd"
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda name, file: None)
    assert base_weights(ModelConfig(name="org/m")) is None  # not cached: unknown
    assert base_weights(ModelConfig()) is None  # the tiny model: its seed is recorded


def without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def test_grpo_resume_auto_with_lora(tmp_path, monkeypatch):
    """The loop's resume path (`checkpointing.resume=auto`) with adapter-only checkpoints. The dense
    golden reward: the arithmetic reward is 0 for a random tiny model, which would train nothing."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "golden"))
    run = (
        "policy.lora.rank=4",
        "policy.lora.alpha=8",
        "policy.optimizer.lr=1e-2",
        "task.reward_fn=golden_reward:reward",
        "grpo.val_period=10",
    )
    whole = small_grpo_cfg(tmp_path / "whole", *run, "grpo.max_num_steps=3")
    run_grpo(whole)
    run_grpo(small_grpo_cfg(tmp_path / "resumed", *run, "grpo.max_num_steps=2"))
    run_grpo(small_grpo_cfg(tmp_path / "resumed", *run, "grpo.max_num_steps=3"))
    keys = ["reward", "train/loss", "train/grad_norm", "completion_length"]
    a = [r for r in read_metrics(tmp_path / "whole" / "metrics.jsonl") if r["step"] == 3]
    b = [r for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if r["step"] == 3]
    assert len(a) == len(b) == 1
    assert [a[0][k] for k in keys] == [b[0][k] for k in keys]
    assert a[0]["train/grad_norm"] > 0  # the adapters trained
    ckpt = tmp_path / "resumed" / "checkpoints" / "step_3"
    assert json.loads((ckpt / "metadata.json").read_text())["trainable_only"] is True
    pol_a, pol_b = Policy(whole.policy), Policy(whole.policy)
    base = params_of(pol_a)
    pol_a.load_checkpoint(tmp_path / "whole" / "checkpoints" / "step_3")
    pol_b.load_checkpoint(ckpt)
    sa, sb = pol_a.full_state_dict(), pol_b.full_state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )


@pytest.mark.parametrize("tied", [False, True])
def test_export_merged_and_adapter_give_the_trainers_logprobs(tmp_path, tied):
    policy = Policy(cfg(model={"tiny": {"tie_word_embeddings": tied}}))
    train(policy, range(2))
    policy.save_checkpoint(tmp_path / "ckpt")
    lp = policy.get_logprobs(BATCHES[0])
    worker = policy.group.workers[0]

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="sdpa")
    assert not any(is_adapter_key(n) for n in merged.state_dict())
    want = policy.full_state_dict()
    assert merged.state_dict().keys() == want.keys()
    assert all(torch.equal(merged.state_dict()[k], want[k]) for k in want)
    assert merged.config.tie_word_embeddings == tied
    torch.testing.assert_close(hf_logprobs(merged, BATCHES[0]), lp, rtol=0, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tok("12+3=15").input_ids == worker.tokenizer("12+3=15").input_ids

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "adapter"), "--adapter"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["r"], config["lora_alpha"]) == ("tiny", 4, 8.0)
    with safe_open(str(tmp_path / "adapter" / export.ADAPTER_WEIGHTS), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    expected = peft_state_dict(worker.model.named_parameters())
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    base = load_full_model(policy.cfg.model, build_tokenizer(policy.cfg.model))
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(hf_logprobs(adapted, BATCHES[0]), lp, rtol=0, atol=1e-5)


def test_export_refusals_and_atomicity(tmp_path, monkeypatch):
    Policy(cfg(lora=None)).save_checkpoint(tmp_path / "full")
    Policy(cfg()).save_checkpoint(tmp_path / "lora")
    with pytest.raises(
        ValueError, match="full fine-tuning checkpoint: it has no LoRA adapters.*Drop --adapter"
    ):
        export.export_hf(tmp_path / "full", tmp_path / "out", adapter=True)
    assert main(["export", str(tmp_path / "full"), str(tmp_path / "out"), "--adapter"]) == 1

    def disk_full(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(export, "save_file", disk_full)
    with pytest.raises(OSError, match="disk full"):
        export.export_hf(tmp_path / "lora", tmp_path / "out", adapter=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "lora"]  # nothing half-written left
    monkeypatch.undo()
    export.export_hf(tmp_path / "lora", tmp_path / "out", adapter=True)
    with pytest.raises(ValueError, match="exists and is not empty"):
        export.export_hf(tmp_path / "lora", tmp_path / "out")


@pytest.mark.parametrize("tied", [False, True])
def test_save_hf_of_a_lora_policy_is_the_merged_model(tmp_path, tied):
    policy = Policy(cfg(model={"tiny": {"tie_word_embeddings": tied}}))
    train(policy, range(1))
    policy.save_hf(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa")
    want = policy.full_state_dict()
    assert loaded.state_dict().keys() == want.keys()
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    assert loaded.config.tie_word_embeddings == tied
    torch.testing.assert_close(
        hf_logprobs(loaded, BATCHES[0]), policy.get_logprobs(BATCHES[0]), rtol=0, atol=1e-5
    )


def test_a_base_given_by_a_relative_path_is_recorded_absolute_and_exports_from_anywhere(
    tmp_path, monkeypatch, capsys
):
    run, base, ckpt = tmp_path / "run", tmp_path / "run" / "base", tmp_path / "run" / "ckpt"
    (tmp_path / "elsewhere").mkdir()
    save_family_model("llama", build_char_tokenizer(), base)
    monkeypatch.chdir(run)
    policy = Policy(cfg(model={"name": "base"}))  # as configs/grpo_arithmetic_lora.yaml names its base
    train(policy, range(1))
    policy.save_checkpoint(ckpt)
    want = policy.full_state_dict()
    meta_file = ckpt / checkpoint.METADATA_FILE
    assert json.loads(meta_file.read_text())["fingerprint"]["config"]["model.name"] == str(base)

    def merged_is_trained(out: str) -> bool:
        got = AutoModelForCausalLM.from_pretrained(out).state_dict()
        return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["export", str(ckpt), "merged"]) == 0 and merged_is_trained("merged")
    assert main(["export", str(ckpt), "adapter", "--adapter"]) == 0
    assert json.loads(Path("adapter/adapter_config.json").read_text())["base_model_name_or_path"] == str(base)

    # a checkpoint written when the path was recorded as the config gave it
    meta = json.loads(meta_file.read_text())
    meta["fingerprint"]["config"]["model.name"] = "base"
    meta_file.write_text(json.dumps(meta))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    assert main(["export", str(ckpt), "again"]) == 1
    said = " ".join(capsys.readouterr().err.split())
    assert f"LoRA checkpoint '{ckpt}': its training config recorded model.name='base'" in said
    assert "relative to the directory the training run was started in" in said
    assert "--base DIR_OR_HUB_NAME" in said
    assert main(["export", str(ckpt), "again", "--base", "../run/base"]) == 0 and merged_is_trained("again")
    monkeypatch.chdir(run)  # it still resumes from its run's directory
    resumed = Policy(cfg(model={"name": "base"}))
    resumed.load_checkpoint(str(ckpt))
    got = resumed.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_resumes_after_its_project_directory_moved(tmp_path, monkeypatch):
    """Checkpoints record local paths absolute; a project moved elsewhere (the recorded path gone, the
    config's relative path found from the new place) still resumes, while another existing base is
    refused by path."""
    base = tmp_path / "a" / "base"
    save_family_model("llama", build_char_tokenizer(), base)
    monkeypatch.chdir(tmp_path / "a")
    policy = Policy(cfg(model={"name": "base"}))
    train(policy, range(1))
    policy.save_checkpoint(tmp_path / "a" / "ckpt")
    want = policy.full_state_dict()
    shutil.move(tmp_path / "a", tmp_path / "b")
    monkeypatch.chdir(tmp_path / "b")
    shutil.move("base", "other")  # a directory of another name is not taken for the recorded one
    with pytest.raises(ValueError, match="model.name"):
        Policy(cfg(model={"name": "other"})).load_checkpoint(str(tmp_path / "b" / "ckpt"))
    shutil.move("other", "base")
    resumed = Policy(cfg(model={"name": "base"}))
    resumed.load_checkpoint(str(tmp_path / "b" / "ckpt"))
    got = resumed.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)

    shutil.copytree(tmp_path / "b", tmp_path / "a")  # the recorded path exists again: another directory
    with pytest.raises(ValueError, match="model.name"):
        resumed.load_checkpoint(str(tmp_path / "b" / "ckpt"))


def test_the_base_digest_reads_sampled_chunks_of_each_weight_file(tmp_path, monkeypatch):
    """Every rank takes the digest when it builds a LoRA model: it reads SAMPLE_CHUNKS chunks spread
    over each file (all of a small file), so a same-shape replacement, which differs everywhere, is seen,
    and a multi-GB base is not read whole."""
    from posttrain.policy import identity

    monkeypatch.setattr(identity, "SAMPLE_CHUNKS", 4)
    monkeypatch.setattr(identity, "CHUNK_BYTES", 4)
    f = tmp_path / "model.safetensors"
    data = bytearray(range(200)) * 5  # 1000 bytes: chunks at 0, 332, 664 and 996
    f.write_bytes(data)
    before = base_weights(ModelConfig(name=str(tmp_path)))
    assert before.startswith("sampled-sha256:")
    for offset, seen in ((333, True), (999, True), (500, False)):
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        f.write_bytes(changed)
        assert (base_weights(ModelConfig(name=str(tmp_path))) != before) is seen, offset
    f.write_bytes(data[:16])  # within the sampled span: every byte counts
    small = base_weights(ModelConfig(name=str(tmp_path)))
    f.write_bytes(data[:15] + b"\x00")
    assert base_weights(ModelConfig(name=str(tmp_path))) != small


def test_a_recorded_tokenizer_not_found_from_here_is_read_from_the_checkpoint(tmp_path, monkeypatch):
    """A checkpoint that recorded its tokenizer as a path relative to its run's directory exports from
    elsewhere (with --base for the model): the tokenizer comes from the files the checkpoint saved."""
    run = tmp_path / "run"
    save_family_model("llama", build_char_tokenizer(), run / "base")
    build_char_tokenizer().save_pretrained(run / "tok")
    monkeypatch.chdir(run)
    policy = Policy(cfg(model={"name": "base", "tokenizer": "tok"}))
    train(policy, range(1))
    policy.save_checkpoint(run / "ckpt")
    want = policy.full_state_dict()
    meta_file = run / "ckpt" / checkpoint.METADATA_FILE
    meta = json.loads(meta_file.read_text())  # as recorded before paths were made absolute
    meta["fingerprint"]["config"].update({"model.name": "base", "model.tokenizer": "tok"})
    meta_file.write_text(json.dumps(meta))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["export", str(run / "ckpt"), "out", "--base", str(run / "base")]) == 0
    got = AutoModelForCausalLM.from_pretrained("out").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
