"""Multi-turn episodes on the environment protocol (scripted engine): token-exact trajectories, masks,
tool calls and their errors, limits, failures that are counted and never rewarded."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from doubles import ScriptedEngine
from posttrain.envs.base import Environment, EnvLimits, EnvReset, EnvSample, EnvStep
from posttrain.envs.build import EnvSuite, build_env
from posttrain.envs.calculator import CalculatorEnvConfig, calc
from posttrain.envs.guess import GuessEnvConfig
from posttrain.envs.sandbox import SandboxUnavailableError
from posttrain.envs.tools import Tool, ToolEnvironment, parse_hermes
from posttrain.generation.params import SamplingParams
from posttrain.models.tokenizer import build_chat_tokenizer
from posttrain.rollout.chat import ChatRenderer
from posttrain.rollout.config import GroupConfig
from posttrain.rollout.episodes import trajectory_rewards
from posttrain.rollout.rows import samples_to_batch
from posttrain.rollout.trajectory import run_group, run_trajectory

END = "<|im_end|>"
SAMPLING = SamplingParams(max_new_tokens=96)


def call(expr: str) -> str:
    return '<tool_call>{"name": "calc", "arguments": {"expr": "' + expr + '"}}</tool_call>'


def suite(make_env, **limits) -> EnvSuite:
    return EnvSuite("test", None, None, make_env, EnvLimits(**limits), parse_hermes)  # type: ignore[arg-type]


def calculator():
    cfg = CalculatorEnvConfig(num_train=20, num_eval=5)
    return cfg, build_env(cfg)


def play(engine, spec, sample, seed=0, stream=0):
    return asyncio.run(run_trajectory(engine, engine.tokenizer, spec, sample, SAMPLING, seed, stream))


def test_calculator_episode_is_token_exact_and_masks_only_replies():
    tok = build_chat_tokenizer()
    cfg, env = calculator()
    sample = EnvSuite.sample(env.train[0])
    a, b = sample.data["a"], sample.data["b"]
    replies = [call(f"{a}*{b}") + END, f"{a * b}" + END]
    engine = ScriptedEngine(tok, lambda prompt, turn: replies[turn])
    traj = play(engine, env, sample)
    assert not traj.failed and traj.reward == 1.0 and traj.solved() and traj.num_tool_calls == 1
    sampled = [tok(r, add_special_tokens=False)["input_ids"] for r in replies]
    # what was trained is what was sampled, in place, and the mask is exactly the sampled tokens
    for turn, ids in zip(traj.turns, sampled):
        assert traj.token_ids[turn.start : turn.end] == ids
    assert [i for i, m in enumerate(traj.mask) if m] == [i for t in traj.turns for i in range(t.start, t.end)]
    # the observation is the tool's answer rendered by the template, and the second turn's prompt is
    # everything so far (the engine continues the same session)
    obs = tok.decode(traj.token_ids[traj.turns[0].end : traj.turns[1].start], skip_special_tokens=False)
    assert obs == f"<|im_start|>tool\n<tool_response>{a * b}</tool_response>{END}<|im_start|>assistant\n"
    (p1, s1), (p2, s2) = engine.calls
    assert p2 == traj.prompt_token_ids + traj.token_ids[: traj.turns[1].start] and s1 == s2
    assert engine.ended == [s1]
    # the opening is the template's rendering with the tool's schema
    assert tok.decode(traj.prompt_token_ids, skip_special_tokens=False).startswith(
        "<|im_start|>systemtools: calc(expr)"
    )


def test_trajectory_rows_train_sampled_tokens_with_engine_logprobs():
    tok = build_chat_tokenizer()
    _, env = calculator()
    samples = [EnvSuite.sample(env.train[i]) for i in range(2)]

    def reply(prompt, turn):
        a, b = prompt.split("user\n")[1].split("=")[0].split("*")
        return [call(f"{a}*{b}") + END, f"{int(a) * int(b) + (turn if 'x' in prompt else 0)}" + END][turn]

    engine = ScriptedEngine(tok, reply)
    trajs = [play(engine, env, s) for s in samples]
    rewards = torch.tensor([t.reward for t in trajs])
    batch, _ = samples_to_batch(
        trajs, rewards, torch.zeros(2, dtype=torch.bool), torch.tensor([0, 1]), GroupConfig(), pad_id=0
    )
    for i, t in enumerate(trajs):
        n = len(t.prompt_token_ids)
        row = batch["input_ids"][i, : n + len(t.token_ids)].tolist()
        assert row == t.prompt_token_ids + t.token_ids
        assert batch["token_mask"][i, n : n + len(t.mask)].tolist() == [float(m) for m in t.mask]
        assert batch["token_mask"][i, :n].sum() == 0
        got = batch["generation_logprobs"][i, n : n + len(t.mask)]
        want = torch.tensor([lp if m else 0.0 for lp, m in zip(t.logprobs, t.mask)])
        torch.testing.assert_close(got, want)


def test_malformed_and_unknown_tool_calls_get_error_observations():
    tok = build_chat_tokenizer()
    _, env = calculator()
    sample = EnvSuite.sample(env.train[0])
    answer = sample.data["answer"]
    replies = [
        "<tool_call>{not json</tool_call>" + END,
        '<tool_call>{"name": "sqrt", "arguments": {"x": "4"}}</tool_call>' + END,
        call("2**") + END,
        f"{answer}" + END,
    ]
    engine = ScriptedEngine(tok, lambda prompt, turn: replies[turn])
    traj = play(
        engine, env.__class__(**{**env.__dict__, "limits": EnvLimits(max_turns=4, max_tokens=400)}), sample
    )
    observations = [
        tok.decode(traj.token_ids[a.end : b.start], skip_special_tokens=False)
        for a, b in zip(traj.turns, traj.turns[1:])
    ]
    assert "error: the tool call is not valid JSON" in observations[0]
    assert "error: unknown tool 'sqrt'; the tools are calc" in observations[1]
    assert (
        "error: ValueError: unsupported expression" in observations[2]
        or "error: ValueError" in observations[2]
    )
    assert not traj.failed and traj.reward == 1.0 and traj.info["tool_errors"] == 3.0


class Stuck(Environment):
    def reset(self):
        return EnvReset([{"role": "user", "content": "1*1=?"}], tools=[self.slow])

    @staticmethod
    def slow(x: str) -> str:
        """Never returns in time.

        Args:
            x: anything
        """
        time.sleep(30)
        return x

    def step(self, message):
        return (
            EnvStep(done=True, reward=1.0)
            if not message.tool_calls
            else EnvStep([{"role": "tool", "content": Tool.from_function(self.slow).fn("x")}])
        )


class Chatty(Environment):
    def reset(self):
        return [{"role": "user", "content": "hi"}]

    def step(self, message):
        return EnvStep([{"role": "user", "content": "more"}])


class Raises(Environment):
    def reset(self):
        return [{"role": "user", "content": "hi"}]

    def step(self, message):
        raise RuntimeError("the environment broke")


def test_stuck_tool_times_out_and_fails_the_trajectory_not_the_step():
    tok = build_chat_tokenizer()
    engine = ScriptedEngine(
        tok, lambda prompt, turn: '<tool_call>{"name": "slow", "arguments": {"x": "a"}}</tool_call>' + END
    )
    spec = suite(Stuck, step_timeout_s=0.3)
    trajs = asyncio.run(run_group(engine, tok, spec, EnvSample(0, {}), 3, SAMPLING, seed=0))
    assert all(t.failed and "timed out after 0.3 s" in t.error for t in trajs)
    assert all(math.isnan(t.reward) for t in trajs)
    assert len(engine.ended) == 3  # every session released


def test_environment_exception_is_counted_never_rewarded():
    tok = build_chat_tokenizer()
    engine = ScriptedEngine(tok, lambda prompt, turn: "hello" + END)
    (traj,) = asyncio.run(run_group(engine, tok, suite(Raises), EnvSample(0, {}), 1, SAMPLING, seed=0))
    assert traj.failed and "RuntimeError: the environment broke" in traj.error and math.isnan(traj.reward)
    ok = play(
        ScriptedEngine(tok, lambda p, t: "1" + END),
        build_env(GuessEnvConfig()),
        EnvSample(0, {"secret": 1, "max_number": 15}),
    )
    rewards = torch.tensor([traj.reward, ok.reward])
    failed = torch.tensor([traj.failed, ok.failed])
    batch, _ = samples_to_batch([traj, ok], rewards, failed, torch.tensor([0, 0]), GroupConfig(), pad_id=0)
    assert batch["sample_mask"].tolist() == [0.0, 1.0]
    assert batch["advantages"][0].abs().sum() == 0  # the failed one enters no advantage


class NoSandbox(Environment):
    """An environment whose sandbox this machine cannot run as configured (raised in reset or step)."""

    def reset(self):
        if self.sample.data["where"] == "reset":
            raise SandboxUnavailableError("the sandbox could not set pids.max: Permission denied")
        return [{"role": "user", "content": "hi"}]

    def step(self, message):
        raise SandboxUnavailableError("the sandbox could not bound the program's processes: EACCES")


class AsyncNoSandbox(NoSandbox):
    async def step(self, message):
        super().step(message)


@pytest.mark.parametrize("where", ["reset", "step", "async step"])
def test_a_sandbox_this_machine_cannot_run_stops_the_run_instead_of_failing_every_trajectory(where):
    tok = build_chat_tokenizer()
    engine = ScriptedEngine(tok, lambda prompt, turn: "hello" + END)
    spec = suite(AsyncNoSandbox if where == "async step" else NoSandbox)
    sample = EnvSample(0, {"where": where.split()[-1]})
    with pytest.raises(SandboxUnavailableError, match="Permission denied|EACCES"):
        asyncio.run(run_group(engine, tok, spec, sample, 2, SAMPLING, seed=0))


class Answers(Environment):
    """Opens with one user message and answers every reply with `self.sample.data["step"]`."""

    def reset(self):
        return self.sample.data.get("opening", [{"role": "user", "content": "hi"}])

    def step(self, message):
        return self.sample.data["step"]


ROLE_CHECK = "{% for m in messages %}{% if m.role == 'narrator' %}{{ raise_exception('no narrator role') }}{% endif %}{% endfor %}"
BAD_ANSWERS = {
    "no messages": ({"step": EnvStep()}, "step() returned no messages and did not end the episode"),
    "not dicts": ({"step": EnvStep(["higher"])}, "step() must give its messages as a list of dicts"),
    "template refuses": (
        {"step": EnvStep([{"role": "narrator", "content": "x"}])},
        "could not render the messages of step(): TemplateError: no narrator role",
    ),
    "empty opening": ({"opening": [], "step": EnvStep()}, "could not render the messages of reset"),
}


@pytest.mark.parametrize("case", BAD_ANSWERS.values(), ids=BAD_ANSWERS.keys())
def test_an_environment_answering_wrongly_fails_its_trajectories_not_the_group(case):
    data, error = case
    tok = build_chat_tokenizer()
    tok.chat_template = ROLE_CHECK + tok.chat_template
    engine = ScriptedEngine(tok, lambda prompt, turn: "ok" + END)
    trajs = asyncio.run(run_group(engine, tok, suite(Answers), EnvSample(0, data), 3, SAMPLING, seed=0))
    assert [t.failed for t in trajs] == [True] * 3 and all(math.isnan(t.reward) for t in trajs)
    assert all(error in t.error for t in trajs), trajs[0].error
    assert len(engine.ended) == 3  # every session released


def test_an_opening_longer_than_max_tokens_fails_its_trajectory_and_is_logged(caplog):
    tok = build_chat_tokenizer()
    engine = ScriptedEngine(tok, lambda prompt, turn: "a" + END)
    spec = suite(Answers, max_tokens=40)
    done = EnvStep(done=True, reward=1.0)
    samples = [
        EnvSample(i, {"opening": [{"role": "user", "content": "x" * n}], "step": done})
        for i, n in enumerate([5, 60])
    ]
    short, long = (play(engine, spec, s) for s in samples)
    assert not short.failed and short.reward == 1.0 and len(engine.calls) == 1  # the long one sampled nothing
    assert long.failed and math.isnan(long.reward) and long.prompt_token_ids == [tok.eos_token_id]
    assert long.error == (
        "the opening messages take 78 tokens and env.limits.max_tokens=40 leaves no room for a reply; raise "
        "env.limits.max_tokens (or shorten the environment's opening)"
    )
    assert long.error in caplog.text
    rewards, failed, metrics = trajectory_rewards([short, long])
    assert failed.tolist() == [False, True] and metrics["env/failed"] == 1.0


def test_limits_cut_the_episode_with_the_truncated_reward():
    tok = build_chat_tokenizer()
    spec = suite(Chatty, max_turns=2, max_tokens=400, truncated_reward=-0.5)
    traj = play(ScriptedEngine(tok, lambda p, t: "abc" + END), spec, EnvSample(0, {}))
    assert traj.finish_reason == "length" and traj.reward == -0.5 and len(traj.turns) == 2
    # the token limit cuts the episode too, before the turns run out
    spec = suite(Chatty, max_turns=50, max_tokens=60, truncated_reward=-0.5)
    traj = play(ScriptedEngine(tok, lambda p, t: "abc" + END), spec, EnvSample(0, {}))
    assert traj.finish_reason == "length" and len(traj.prompt_token_ids) + len(traj.token_ids) <= 60
    # a reply that never closes its turn ends the episode at once
    traj = play(ScriptedEngine(tok, lambda p, t: "7" * 200), spec, EnvSample(0, {}))
    assert traj.finish_reason == "length" and len(traj.turns) == 1


HISTORY_REWRITING = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and not loop.last %}{{ (m.content or '').split('</think>')[-1] }}"
    "{%- else %}{{ m.content }}{% endif %}<|im_end|>{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_history_rewriting_template_is_caught_and_trained_ids_stay_sampled():
    tok = build_chat_tokenizer()
    tok.chat_template = HISTORY_REWRITING  # drops <think> blocks of earlier assistant turns
    env = build_env(GuessEnvConfig())
    sample = EnvSample(0, {"secret": 5, "max_number": 15})
    replies = ["think: lo1 hi15</think>8" + END, "think: lo1 hi7</think>4" + END, "think: 5</think>5" + END]
    engine = ScriptedEngine(tok, lambda p, t: replies[t])
    traj = play(engine, env, sample)
    assert traj.reward > 0 and len(traj.turns) == 3
    sampled = [tok(r, add_special_tokens=False)["input_ids"] for r in replies]
    assert [traj.token_ids[t.start : t.end] for t in traj.turns] == sampled
    # re-rendering the conversation (what a naive implementation trains on) differs from what was sampled
    messages = [{"role": "user", "content": "guess 1-15"}]
    for r, fb in zip(replies, ["lower", "higher", None]):
        messages.append({"role": "assistant", "content": r.removesuffix(END)})
        if fb:
            messages.append({"role": "user", "content": fb})
    naive = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert naive != traj.prompt_token_ids + traj.token_ids
    assert "</think>" not in tok.decode(naive[: len(naive) // 2], skip_special_tokens=False)
    assert tok.decode(traj.token_ids, skip_special_tokens=False).count("</think>") == 3


# as Qwen3's official template: an empty thinking block before the last assistant reply only, dropped
# once more messages follow
LAST_REPLY_THINKS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_renders_the_last_reply_apart_gives_the_observations_it_renders_in_a_conversation():
    tok = build_chat_tokenizer()
    tok.chat_template = LAST_REPLY_THINKS
    obs = ChatRenderer(tok).observation([{"role": "user", "content": "higher"}])
    assert (
        tok.decode(obs, skip_special_tokens=False)
        == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    )
    replies = ["8" + END, "4" + END, "5" + END]
    traj = play(
        ScriptedEngine(tok, lambda p, t: replies[t]),
        build_env(GuessEnvConfig()),
        EnvSample(0, {"secret": 5, "max_number": 15}),
    )
    assert not traj.failed and traj.reward == pytest.approx(1 - 2 / 5) and len(traj.turns) == 3
    # the row is the conversation as the template renders it with the turns that follow
    messages = [{"role": "user", "content": "guess 1-15"}]
    for r, fb in zip(replies, ["lower", "higher"]):
        messages += [{"role": "assistant", "content": r.removesuffix(END)}, {"role": "user", "content": fb}]
    whole = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + replies[-1]
    assert tok.decode(traj.prompt_token_ids + traj.token_ids, skip_special_tokens=False) == whole


def test_renderer_refuses_a_template_that_drops_a_finished_reply():
    tok = build_chat_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}(earlier reply){% else %}{{ m.content }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="renders a finished assistant turn the same way whatever follows"):
        ChatRenderer(tok).observation([{"role": "user", "content": "higher"}])


def test_renderer_refuses_a_template_without_a_special_end_of_turn():
    tok = build_chat_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match="not a special token"):
        ChatRenderer(tok)


def test_tool_schema_and_hermes_parser():
    schema = Tool.from_function(calc).schema["function"]
    assert schema["name"] == "calc" and schema["parameters"]["required"] == ["expr"]
    calls = parse_hermes('x <tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"1+2\\"}"}</tool_call>')
    assert calls[0].name == "calc" and calls[0].arguments == {"expr": "1+2"} and calls[0].error is None
    (bad,) = parse_hermes("<tool_call>[1, 2]</tool_call>")
    assert bad.error and bad.name is None

    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="type hints"):
        Tool.from_function(undocumented)


def test_a_reply_ended_by_another_stop_token_is_closed_as_context():
    tok = build_chat_tokenizer()
    _, env = calculator()
    sample = EnvSuite.sample(env.train[0])
    a, b = sample.data["a"], sample.data["b"]
    replies = [call(f"{a}*{b}"), f"{a * b}" + END]  # the first stops at </tool_call>, without <|im_end|>
    engine = ScriptedEngine(tok, lambda prompt, turn: replies[turn])
    stop = tok.convert_tokens_to_ids("</tool_call>")
    traj = asyncio.run(
        run_trajectory(engine, tok, env, sample, SAMPLING.model_copy(update={"stop_token_ids": [stop]}), 0)
    )
    assert traj.reward == 1.0 and traj.num_tool_calls == 1
    first = traj.turns[0]
    assert traj.token_ids[first.end] == tok.convert_tokens_to_ids(END) and traj.mask[first.end] == 0


def test_trajectories_survive_the_checkpoint_codec():
    import json

    from posttrain.rollout.rows import SAMPLES_CODEC, GroupSamples

    tok = build_chat_tokenizer()
    _, env = calculator()
    sample = EnvSuite.sample(env.train[0])
    good = play(ScriptedEngine(tok, lambda p, t: [call("2*3") + END, "6" + END][t]), env, sample)
    bad = asyncio.run(
        run_trajectory(ScriptedEngine(tok, lambda p, t: "x" + END), tok, suite(Raises), sample, SAMPLING, 0)
    )
    group = GroupSamples(sample.sample_id, [good, bad], [good.reward, math.nan], [False, True], {"x": 1.0})
    back = SAMPLES_CODEC.decode(json.loads(json.dumps(SAMPLES_CODEC.encode(group), allow_nan=False)))
    assert back.results[0] == good and back.results[1].failed and math.isnan(back.results[1].reward)
    assert back.results[1].error == bad.error and back.failed == [False, True]


def test_a_custom_environment_loads_by_path_and_plays(tmp_path):
    code = tmp_path / "my_env.py"
    code.write_text(
        "from posttrain.envs.base import Environment, EnvStep\n"
        "class Echo(Environment):\n"
        "    def reset(self):\n"
        "        return [{'role': 'user', 'content': self.sample.data['q']}]\n"
        "    async def step(self, message):\n"
        "        return EnvStep(done=True, reward=float(message.content == self.sample.data['a']))\n"
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"q": "say hi", "a": "hi"}\n{"q": "say yo", "a": "yo"}\n')
    from posttrain.envs.build import CustomEnvConfig

    spec = build_env(CustomEnvConfig(env_class=f"{code}:Echo", train_path=str(rows)))
    assert len(spec.train) == 2 and spec.eval is None
    tok = build_chat_tokenizer()
    traj = play(ScriptedEngine(tok, lambda p, t: "hi" + END), spec, EnvSuite.sample(spec.train[0]))
    assert traj.reward == 1.0 and tok.decode(traj.prompt_token_ids, skip_special_tokens=False).endswith(
        "say hi<|im_end|><|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="environment class .* has no attribute 'Nope'"):
        build_env(CustomEnvConfig(env_class=f"{code}:Nope", train_path=str(rows)))


def test_the_readme_environment_example_plays(tmp_path):
    """The README's "your own environment in 20 lines" runs as written."""
    from pathlib import Path

    from posttrain.envs.build import CustomEnvConfig

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = readme.split("```python\n# my_env.py\n", 1)[1].split("```", 1)[0]
    assert len([line for line in code.splitlines() if line.strip()]) <= 20
    (tmp_path / "my_env.py").write_text(code)
    rows = tmp_path / "cities.jsonl"
    rows.write_text('{"city": "Paris", "answer": "18"}\n{"city": "Oslo", "answer": "4"}\n')
    spec = build_env(CustomEnvConfig(env_class=f"{tmp_path / 'my_env.py'}:Weather", train_path=str(rows)))
    tok = build_chat_tokenizer()
    lookup = '<tool_call>{"name": "lookup", "arguments": {"city": "Paris"}}</tool_call>' + END
    traj = play(
        ScriptedEngine(tok, lambda p, t: [lookup, "It is 18." + END][t]), spec, EnvSuite.sample(spec.train[0])
    )
    assert traj.reward == 1.0 and traj.num_tool_calls == 1 and traj.solved()
    assert "<tool_response>18</tool_response>" in tok.decode(traj.token_ids, skip_special_tokens=False)


RELEASE = None  # set by the test below: the hanging tool's thread waits on it


def hang(x: str) -> str:
    """Blocks until the test releases it.

    Args:
        x: anything
    """
    RELEASE.wait()
    return x


class HangingTools(ToolEnvironment):
    tools = [hang]

    def reset(self):
        return EnvReset([{"role": "user", "content": "go"}], self.tools)

    def finish(self, reply):
        return EnvStep(done=True, reward=1.0)


def test_a_tool_that_never_returns_does_not_hold_up_the_step():
    """The blocking path of the synchronous loop (asyncio.run per step) returns once the step times
    out, although the tool's thread is still blocked."""
    import threading

    from posttrain.rollout.episodes import play_step
    from posttrain.tasks.datasets import PromptItem

    global RELEASE
    RELEASE = threading.Event()
    tok = build_chat_tokenizer()
    spec = suite(HangingTools, step_timeout_s=0.2)
    items = [PromptItem(0, "{}", [], {})]
    engine = ScriptedEngine(
        tok, lambda p, t: '<tool_call>{"name": "hang", "arguments": {"x": "a"}}</tool_call>' + END
    )
    box = []
    worker = threading.Thread(
        target=lambda: box.append(play_step(engine, tok, spec, items, 2, SAMPLING, 0)), daemon=True
    )
    worker.start()
    worker.join(timeout=20)
    try:
        assert not worker.is_alive(), "the step waited for a tool that never returns"
        assert all(t.failed and "timed out" in t.error for t in box[0])
    finally:
        RELEASE.set()
