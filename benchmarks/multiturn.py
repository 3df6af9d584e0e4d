"""Multi-turn rollouts: the engine's session KV reuse vs prefilling every turn's prompt whole, and GRPO
with a tool-calling environment vs TRL's `GRPOTrainer`.

KV reuse. A tiny-chat Llama (hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 768; the 106-token
tiny-chat vocabulary) plays `FourTurns`, a benchmark environment whose every episode has exactly four
assistant turns: an opening user message of `opening` characters (one token each), then after each of
the first three replies a user message of `observation` characters, then the end. Replies are sampled
at temperature 1 (seeded, the rollout layer's per-turn streams) and end at the end-of-turn token or at
one of six common characters (`sampling.stop_token_ids`: an untrained model then ends a turn after
about 15 tokens), at most `max_reply` tokens; a reply that hits that bound ends its episode early
(counted). All trajectories of a run are played concurrently through `play_step`, the synchronous
GRPO loop's rollout (groups of `generations` trajectories of one sample).

The same trajectories (same samples, same seeds) run on two engines built from the same weights, one
with `GenerationConfig.session_kv_reuse=True` (turn k prefills only the observation after the kept
keys/values) and one with `False` (turn k prefills the whole conversation so far), in interleaved
rounds whose order alternates, after one warm-up run each. Throughput counts, per trajectory, every
token after the opening: the sampled reply tokens plus the observation tokens (the rendered user
messages, with their chat markup, and the end-of-turn token appended when a reply ended at another
stop token), divided by the run's wall time. The opening is not counted (both sides prefill it once).
The speedup is the median over rounds of the paired time ratios. Both engines must produce identical
token ids (checked every round, printed).

vs TRL. The built-in calculator environment (products of a 3- and a 2-digit number, a `calc` tool) under
posttrain's synchronous `run_grpo` (`env:` set) and under TRL's `GRPOTrainer(tools=[calc])` (TRL's own
tool loop, transformers `generate`, no vLLM), both from the same posttrain SFT warm start on the
calculator's demonstrations (the calculator demo's tiny-chat model: hidden 128, 2 layers). Same
prompt ids on both sides (checked), prompts x generations per step, at most 3 replies per episode (TRL:
`max_tool_calling_iterations=2`) and `max_completion` tokens after the prompt (replies and tool results;
posttrain: `env.limits.max_tokens` = prompt + that, TRL: `max_completion_length`), temperature 1, and
the loss settings of vs_trl.py (its docstring has the mapping). The reward is the environment's: 1 for
the exact product in a final reply without a tool call. A turn ends at `<|im_end|>` on both sides (TRL
stops at the model's `generation_config.eos_token_id`, set to it and EOS).

TRL needs a way to read tool calls back from the model's text: it ships response templates for named
model families only and asks for one to be set on any other tokenizer, so the TRL side gets
`TINY_CHAT_RESPONSE` (ChatML with Hermes-style `<tool_call>` JSON, what tiny-chat writes). `trl_blocker`
checks what TRL needs before anything runs; when one is missing the benchmark prints why and no
`multiturn_vs_trl` line. Timing as in vs_trl.py: the two sides run as two processes of one intra-op
thread each, in lockstep, one step each in turn; a step is timed around the whole step on both sides;
medians over every step but each run's first, seeds alternating which side goes first. The ratio is
posttrain's steps/s over TRL's.

    python benchmarks/multiturn.py [--quick] [--rounds N] [--threads N] [--no-trl] [--workdir DIR]

needs trl and datasets (pip install -e .[bench]) unless --no-trl.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import ChildDied, median, require, result_line, run_main, start, watch  # noqa: E402
from vs_trl import SIDES, Lockstep  # noqa: E402

from posttrain.envs.base import Environment, EnvLimits, EnvSample, EnvStep, Message  # noqa: E402
from posttrain.envs.build import EnvSuite  # noqa: E402
from posttrain.envs.tools import parse_hermes  # noqa: E402
from posttrain.generation.engine import GenerationEngine  # noqa: E402
from posttrain.generation.params import GenerationConfig, SamplingParams  # noqa: E402
from posttrain.models.hf import build_tiny_model  # noqa: E402
from posttrain.models.tokenizer import build_chat_tokenizer  # noqa: E402
from posttrain.rollout.episodes import play_step  # noqa: E402
from posttrain.rollout.trajectory import Trajectory  # noqa: E402
from posttrain.tasks.datasets import PromptItem  # noqa: E402

TURNS = 4
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
STOP_CHARS = "aeiost"  # with the end-of-turn token: an untrained model ends a turn after ~15 tokens
LETTERS = "abcdefghijklmnopqrstuvwxyz "


@dataclasses.dataclass(frozen=True)
class Setting:
    """Shape of one rollout run: `samples` x `generations` trajectories of `TURNS` turns."""

    samples: int
    generations: int
    opening: int  # characters (= tokens) of the opening user message
    observation: int  # characters of each observation's user message
    max_reply: int  # tokens per reply at most
    rounds: int

    @property
    def trajectories(self) -> int:
        return self.samples * self.generations

    @property
    def max_len(self) -> int:
        return self.opening + TURNS * self.max_reply + (TURNS - 1) * (self.observation + 16) + 32


QUICK = Setting(samples=4, generations=4, opening=256, observation=64, max_reply=96, rounds=1)
FULL = Setting(samples=8, generations=8, opening=320, observation=80, max_reply=96, rounds=3)


def _text(sample_id: int, turn: int, n: int) -> str:
    g = torch.Generator().manual_seed(1000 * sample_id + turn)
    return "".join(LETTERS[i] for i in torch.randint(len(LETTERS), (n,), generator=g).tolist())


class FourTurns(Environment):
    """Exactly `TURNS` assistant turns: a fixed-length opening, a fixed-length observation after each of
    the first `TURNS - 1` replies, then the end (reward 0). Text is seeded by the sample and turn."""

    def __init__(self, sample: EnvSample) -> None:
        super().__init__(sample)
        self.turns = 0

    def reset(self) -> list[Message]:
        return [{"role": "user", "content": _text(self.sample.sample_id, 0, self.sample.data["opening"])}]

    def step(self, message) -> EnvStep:
        self.turns += 1
        if self.turns >= TURNS:
            return EnvStep(done=True, reward=0.0)
        text = _text(self.sample.sample_id, self.turns, self.sample.data["observation"])
        return EnvStep([{"role": "user", "content": text}])


def four_turn_suite(s: Setting) -> tuple[EnvSuite, list[PromptItem]]:
    """The benchmark environment as a suite, and the items of one run (one per sample)."""
    limits = EnvLimits(max_turns=TURNS, max_tokens=s.max_len, max_tokens_per_turn=s.max_reply)
    suite = EnvSuite("four_turns", None, None, FourTurns, limits, parse_hermes)
    data = {"opening": s.opening, "observation": s.observation}
    return suite, [PromptItem(i, "", [], dict(data)) for i in range(s.samples)]


@dataclasses.dataclass
class Run:
    """One rollout run: its wall time, its trajectories and the engine counters it moved."""

    seconds: float
    trajs: list[Trajectory]
    prefill: int  # tokens the engine ran through prefill forwards during the run
    reused: int  # prompt tokens whose keys/values came from a kept session

    @property
    def tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.trajs)

    @property
    def sampled(self) -> int:
        return sum(sum(t.mask) for t in self.trajs)


class Side:
    """One engine (reuse on or off) and how to play a run on it."""

    def __init__(self, reuse: bool, s: Setting, tok, suite: EnvSuite, sampling: SamplingParams) -> None:
        cfg = GenerationConfig(
            max_num_seqs=s.trajectories,
            max_model_len=s.max_len,
            session_kv_reuse=reuse,
            max_cached_sessions=max(256, s.trajectories),
        )
        self.engine = GenerationEngine(build_tiny_model(len(tok), seed=0, **SHAPE).eval(), tok, cfg)
        self.s, self.tok, self.suite, self.sampling = s, tok, suite, sampling

    def play(self, items: list[PromptItem], seed: int) -> Run:
        e = self.engine
        p0, r0 = e.num_prefill_tokens, e.num_reused_tokens
        t0 = time.perf_counter()
        trajs = play_step(e, self.tok, self.suite, items, self.s.generations, self.sampling, seed)
        seconds = time.perf_counter() - t0
        return Run(seconds, trajs, e.num_prefill_tokens - p0, e.num_reused_tokens - r0)


def same_tokens(a: Run, b: Run) -> bool:
    return [t.prompt_token_ids + t.token_ids for t in a.trajs] == [
        t.prompt_token_ids + t.token_ids for t in b.trajs
    ]


def play_rounds(s: Setting) -> tuple[dict[bool, list[Run]], bool]:
    """The runs of both engines by `session_kv_reuse` (warm-up excluded), and whether every pair of
    runs sampled identical token ids (warm-up included)."""
    tok = build_chat_tokenizer()
    suite, items = four_turn_suite(s)
    stops = tok.convert_tokens_to_ids(list(STOP_CHARS))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=s.max_reply, stop_token_ids=stops)
    on, off = Side(True, s, tok, suite, sampling), Side(False, s, tok, suite, sampling)
    for a, b in zip(on.engine.model.state_dict().values(), off.engine.model.state_dict().values()):
        assert torch.equal(a, b), "the two engines must start from the same weights"
    identical = same_tokens(on.play(items, seed=0), off.play(items, seed=0))  # warm-up
    runs: dict[bool, list[Run]] = {True: [], False: []}
    for r in range(s.rounds):
        for side in (on, off) if r % 2 == 0 else (off, on):
            runs[side is on].append(side.play(items, seed=1 + r))
        identical &= same_tokens(runs[True][-1], runs[False][-1])
    return runs, identical


def kv_reuse(s: Setting) -> float:
    """Run the comparison of the module docstring; prints it and returns the median speedup."""
    print(
        f"model: tiny-chat llama {SHAPE}, vocab {len(build_chat_tokenizer())}; {s.samples} samples x "
        f"{s.generations} generations = {s.trajectories} concurrent trajectories of {TURNS} turns"
    )
    print(
        f"opening {s.opening} chars, observations {s.observation} chars, replies <= {s.max_reply} tokens "
        f"(stop at end-of-turn or one of {STOP_CHARS!r}), temperature 1, seeded; threads "
        f"{torch.get_num_threads()}; {s.rounds} round(s), interleaved, after one warm-up run each"
    )
    runs, identical = play_rounds(s)
    for reuse, label in ((True, "kv reuse  "), (False, "re-prefill")):
        rs = runs[reuse]
        print(
            f"{label} {median([x.tokens / x.seconds for x in rs]):8.1f} tok/s "
            f"(sampled only {median([x.sampled / x.seconds for x in rs]):6.1f})  median run "
            f"{median([x.seconds for x in rs]):6.2f}s  prefill tokens/run {median([x.prefill for x in rs]):7.0f}"
            f"  reused tokens/run {median([x.reused for x in rs]):7.0f}"
        )
    last = runs[True][-1]
    turns = [len(t.turns) for t in last.trajs]
    print(
        f"per run (last round): {last.tokens} counted tokens = {last.sampled} sampled + "
        f"{last.tokens - last.sampled} observation; {last.sampled / sum(turns):.1f} sampled tokens/reply; "
        f"{sum(n == TURNS for n in turns)}/{len(turns)} trajectories played all {TURNS} turns "
        f"(the rest hit the reply bound); opening {len(last.trajs[0].prompt_token_ids)} tokens"
    )
    print(f"identical token ids with and without reuse in every run: {'yes' if identical else 'NO'}")
    if not identical:
        sys.exit("multiturn.py: the two engines sampled different tokens; the runs are not like for like")
    ratios = [b.seconds / a.seconds for a, b in zip(runs[True], runs[False])]
    print(
        f"speedup (median of paired runs): {median(ratios):.2f}x  [{', '.join(f'{x:.2f}' for x in ratios)}]"
    )
    return median(ratios)


# --------------------------------------------------------------------------- vs TRL: the calculator env

CHAT_TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}  # the calculator demo's
CALC_ENV = {"name": "calculator", "num_train": 2000, "num_eval": 64, "direct_answer_fraction": 0.6}
END_OF_TURN = "<|im_end|>"
# How TRL reads tool calls from tiny-chat replies (transformers' `response_template` format): TRL knows the
# templates of named model families only and asks for one to be set on any other tokenizer.
TINY_CHAT_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>", "content": "text"},
    },
}


@dataclasses.dataclass(frozen=True)
class TrlSetting:
    """What both sides share (see `vs_trl.py` for the config mapping; here with tools)."""

    sft_steps: int
    prompts_per_step: int
    generations: int
    max_completion: int  # tokens of an episode after its prompt: replies and tool results
    steps: int
    seeds: tuple[int, ...]
    max_turns: int = 3  # replies per episode (TRL: max_tool_calling_iterations = max_turns - 1)
    temperature: float = 1.0
    lr: float = 1e-3
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    sft_lr: float = 3e-3
    sft_batch: int = 32

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.generations


TRL_QUICK = TrlSetting(
    sft_steps=20, prompts_per_step=2, generations=4, max_completion=128, steps=3, seeds=(0,)
)
TRL_FULL = TrlSetting(
    sft_steps=200, prompts_per_step=8, generations=8, max_completion=128, steps=12, seeds=(0, 1)
)


def trl_tokenizer(init: Path | None = None):
    """The tiny-chat tokenizer as TRL needs it: with the response template (see TINY_CHAT_RESPONSE)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(init) if init is not None else build_chat_tokenizer()
    tok.response_template = TINY_CHAT_RESPONSE
    return tok


def trl_blocker() -> str | None:
    """Why TRL's GRPOTrainer cannot run the calculator environment on tiny-chat here, or None: it
    needs transformers >= 5.0 for tools, a chat template that renders a whole tool exchange, and a
    response template under which `parse_response` reads back a tool call."""
    import transformers
    from packaging.version import Version
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    from posttrain.envs.calculator import calc

    if Version(transformers.__version__) < Version("5.0.0"):
        return f"TRL's tool calling needs transformers >= 5.0 (installed {transformers.__version__})"
    tok = trl_tokenizer()
    if not supports_tool_calling(tok):
        return "trl.chat_template_utils.supports_tool_calling(tiny-chat tokenizer) is False"
    if not is_chat_template_prefix_preserving(tok):
        return "the tiny-chat template is not prefix-preserving (TRL would replace it)"
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "3*4"}}</tool_call>' + END_OF_TURN
    ids = tok(call, add_special_tokens=False)["input_ids"]
    question = [{"role": "user", "content": "3*4=?"}]
    prefix = tok.apply_chat_template(question, tools=[calc], add_generation_prompt=True, return_dict=False)
    try:
        parsed = tok.parse_response(ids, prefix=list(prefix), tools=[calc])
    except Exception as e:
        return f"tokenizer.parse_response cannot read a tiny-chat tool call ({type(e).__name__}: {e})"
    got = (parsed or {}).get("tool_calls") or [{}]
    if got[0].get("function") != {"name": "calc", "arguments": {"expr": "3*4"}}:
        return f"tokenizer.parse_response reads a tiny-chat tool call as {parsed!r}"
    return None


def calc_warm_start(s: TrlSetting, out: Path) -> Path:
    """posttrain SFT of the tiny-chat model on the calculator's demonstrations; both sides start from
    `<out>/hf` (model, tokenizer and chat template)."""
    from vs_trl import warm_start

    model = {"name": "tiny", "tokenizer": "tiny-chat", "tiny": CHAT_TINY}
    return warm_start(s, out, model, {"env": CALC_ENV})


def calc_env_config(s: TrlSetting, prompt_len: int) -> dict:
    limits = {"max_turns": s.max_turns, "max_tokens": prompt_len + s.max_completion}
    return {**CALC_ENV, "limits": limits}


def calc_prompt_ids(tok) -> list[list[int]]:
    """The opening ids of every training episode, as posttrain renders them."""
    from posttrain.envs.build import build_env
    from posttrain.envs.calculator import CalculatorEnvConfig
    from posttrain.rollout.chat import ChatRenderer
    from posttrain.rollout.trajectory import opening

    suite = build_env(CalculatorEnvConfig.model_validate(CALC_ENV))
    out = []
    for it in suite.train.items:
        messages, tools = opening(suite.make_env(suite.sample(it)).reset(), None)
        out.append(ChatRenderer(tok, tools).prompt(messages))
    return out


def train_posttrain(s: TrlSetting, init: Path, out: Path, seed: int, gate, prompt_len: int) -> dict:
    """run_grpo on the calculator environment from `init`, each step gated by `gate` (vs_trl.py's
    posttrain side, with `env:` in place of its task)."""
    from vs_trl import posttrain_config, run_gated

    source = {"env": calc_env_config(s, prompt_len)}
    cfg = posttrain_config(s, init, out, seed, source, s.max_completion)
    times, _, records, phases = run_gated(cfg, gate)
    return {
        "step_times": times,
        "phases": phases,
        "reward": mean([r["reward"] for r in records]),
        "tool_calls": mean([r["env/tool_calls"] for r in records]),
        "sampled": mean([r["env/sampled_tokens"] for r in records]),
    }


def train_trl(s: TrlSetting, init: Path, out: Path, seed: int, gate, prompt_len: int) -> dict:
    """TRL GRPOTrainer(tools=[calc]) from `init` on CPU, the same settings (vs_trl.py's mapping)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback
    from trl import GRPOTrainer

    from posttrain.envs.build import build_env
    from posttrain.envs.calculator import CalculatorEnvConfig, calc, read_answer

    tok = trl_tokenizer(init)
    suite = build_env(CalculatorEnvConfig.model_validate(CALC_ENV))
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{it.metadata['a']}*{it.metadata['b']}=?"}],
            "answer": it.metadata["answer"],
        }
        for it in suite.train.items
    ]
    ours = calc_prompt_ids(tok)
    theirs = [
        tok.apply_chat_template(
            r["prompt"], tools=[calc], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for r in rows
    ]
    assert [list(t) for t in theirs] == ours, "TRL must see the same prompt ids as posttrain"
    assert {len(p) for p in ours} == {prompt_len}

    def calculator_reward(completions, answer, **_):
        """1 for the exact product in the last reply without a tool call (posttrain's `finish`), else 0."""
        out = []
        for messages, want in zip(completions, answer):
            last = messages[-1] if messages else {}
            final = last.get("role") == "assistant" and not last.get("tool_calls")
            out.append(float(final and read_answer(last.get("content") or "") == str(want)))
        return out

    from vs_trl import gated_timer, trl_args

    args = trl_args(s, out, seed, s.max_completion, max_tool_calling_iterations=s.max_turns - 1)
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32, attn_implementation="sdpa")
    # a turn ends at <|im_end|> (posttrain stops there and at EOS; TRL stops at these ids)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(END_OF_TURN), tok.eos_token_id]
    timer = gated_timer(gate)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=calculator_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        tools=[calc],
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "step_times": timer.times,
        "phases": {},
        "reward": mean([h["reward"] for h in logs]),
        "tool_calls": mean([h["tools/call_frequency"] for h in logs]),
        "sampled": mean([h["completions/mean_length"] for h in logs]),  # tool results not counted
    }


TRAIN = {"posttrain": train_posttrain, "trl": train_trl}


def _side_main(side: str, s: TrlSetting, init: Path, out: Path, seed: int, gate, prompt_len, results) -> None:
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(1)  # as vs_trl.py: one intra-op thread per process on the shared machine
    gate.me = SIDES.index(side)
    results[side] = TRAIN[side](s, init, out, seed, gate, prompt_len)


def run_trl_pair(s: TrlSetting, init: Path, root: Path, seed: int, first: str, prompt_len: int) -> dict:
    """One posttrain and one TRL run with `seed` in lockstep (vs_trl.py's `Lockstep`)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    gate = Lockstep(ctx, SIDES.index(first))
    with ctx.Manager() as manager:
        results = manager.dict()
        children = {
            side: (_side_main, (side, s, init, root / f"{side}_seed{seed}", seed, gate, prompt_len, results))
            for side in SIDES
        }
        watch(start(ctx, children), abort=gate.abort)
        missing = [side for side in SIDES if side not in results]
        if missing:
            raise ChildDied(f"the {' and '.join(missing)} process exited without a result")
        return dict(results)


def vs_trl(s: TrlSetting, workdir: str | None) -> float | None:
    """posttrain steps/s divided by TRL steps/s on the calculator environment (None: TRL cannot run it)."""
    blocker = trl_blocker()
    if blocker:
        print(f"TRL cannot run the calculator environment on tiny-chat: {blocker}")
        return None
    torch.set_num_threads(1)  # the warm start too: one thread per process, as both sides
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(workdir or tmp)
        t0 = time.perf_counter()
        init = calc_warm_start(s, root / "sft")
        prompt_len = len(calc_prompt_ids(trl_tokenizer(init))[0])
        print(f"calculator warm start: {s.sft_steps} SFT steps in {time.perf_counter() - t0:.1f}s")
        for i, seed in enumerate(s.seeds):
            results = run_trl_pair(s, init, root, seed, SIDES[i % 2], prompt_len)
            for side in SIDES:
                r = results[side]
                times[side] += r["step_times"][1:]  # the first step carries warm-up
                print(
                    f"{side:9s} seed={seed} median_step={median(r['step_times'][1:]):.3f}s "
                    f"means over steps: reward={r['reward']:.2f} tool_calls/episode={r['tool_calls']:.2f} "
                    f"sampled tokens/episode={r['sampled']:.1f}"
                    + "".join(f" {k}={v:.3f}" for k, v in r["phases"].items())
                )
    ours, trl = median(times["posttrain"]), median(times["trl"])
    print(
        f"calculator env: tiny-chat llama {CHAT_TINY}; {s.prompts_per_step} prompts x {s.generations} "
        f"generations, <= {s.max_turns} replies and {s.max_completion} tokens after the {prompt_len}-token "
        f"prompt per episode, {s.steps} steps, seeds {list(s.seeds)}, 1 thread per process, lockstep"
    )
    print(f"seconds/step median: posttrain {ours:.3f}  trl {trl:.3f}  ({trl / ours:.2f}x)")
    return trl / ours


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick", action="store_true", help="smaller batches, one round, 3 TRL steps (< 1 minute)"
    )
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 1 quick, 3 full)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads for the KV-reuse part")
    ap.add_argument("--no-trl", action="store_true", help="skip the comparison with TRL")
    ap.add_argument(
        "--workdir", default=None, help="keep the TRL comparison's runs here (default: a temp dir)"
    )
    args = ap.parse_args()
    if not args.no_trl:
        require("trl", "datasets")  # before anything runs
    if args.threads:
        torch.set_num_threads(args.threads)
    s = QUICK if args.quick else FULL
    if args.rounds:
        s = dataclasses.replace(s, rounds=args.rounds)
    speedup = kv_reuse(s)
    ratio = None if args.no_trl else vs_trl(TRL_QUICK if args.quick else TRL_FULL, args.workdir)
    print(result_line("multiturn_kv_reuse_speedup", speedup, ">=1.5"))
    if ratio is not None:
        print(result_line("multiturn_vs_trl", ratio, ">=1.0"))


if __name__ == "__main__":
    run_main(main)
