"""Built-in environment (c): write a small Python function; unit tests in a sandbox give the reward.

The problems (envs/code_problems.py) are generated in code from a few templates with parameters
("Write a Python function f(x) that returns x*3+1", "... the list xs reversed", ...), each with a
one-line reference solution (`code_demonstration` makes it a warm-start episode) and 3-5 asserts.

An episode: the model answers with a ```python block; the last such block is run with the tests in
the sandbox (envs/sandbox.py). All tests pass: done, reward 1. Otherwise the model gets the first
failing assert (or error, or why the sandbox stopped the code) and tries again, up to `max_attempts`;
after the last attempt the reward is the fraction of tests that attempt passed (0 when the sandbox
killed it). A reply without a code block counts as an attempt that passed nothing.

The verdict is the trainer's, not the sandbox's: the program run there holds the solution and, after
it, only the call of each test (`f(3)`, never the expected value); it prints each call's value
serialized with `json.dumps` (an object that is not JSON as `{"<object>": repr}`) on one line keyed
by a nonce it reads from stdin before the solution runs. The trainer's process parses the asserts,
takes the expected values from their literals and compares serializations: an object whose `__eq__`
always says True passes nothing, and so does a solution that rewrites the harness, `builtins` or
`json` in its interpreter; all it controls is the values it reports, which must be the right ones.
(The sandbox is no security boundary: a program that finds the problem set on disk can still read the
answers; see envs/sandbox.py.)
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.envs.base import (
    AssistantMessage,
    EnvConfigBase,
    Environment,
    EnvLimits,
    EnvSample,
    EnvStep,
    Message,
)
from posttrain.envs.code_problems import NUM_BUILTIN_PROBLEMS, draw_problems
from posttrain.envs.sandbox import Killed, SandboxConfig, SandboxResult, arun_python


class CodeEnvConfig(EnvConfigBase):
    """Function-writing problems checked by unit tests in a sandbox."""

    name: Literal["code"] = "code"
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    num_problems: int = Field(
        60, ge=2, le=NUM_BUILTIN_PROBLEMS, description="size of the built-in problem set (train + held-out)"
    )
    eval_fraction: float = Field(
        0.2, gt=0, lt=1, description="share of the problems held out (never trained on)"
    )
    max_attempts: int | None = Field(
        None, ge=1, description="code answers per episode before it ends on its own (None: limits.max_turns)"
    )
    feedback_chars: int = Field(
        240, ge=40, description="feedback to the model is cut to this many characters"
    )
    limits: EnvLimits = Field(default_factory=lambda: EnvLimits(max_turns=2, max_tokens=768))

    @model_validator(mode="after")
    def _check(self) -> CodeEnvConfig:
        if self.max_attempts is not None and self.max_attempts > self.limits.max_turns:
            raise ValueError(
                f"max_attempts={self.max_attempts} exceeds limits.max_turns={self.limits.max_turns}: the rollout "
                "would cut the episode first; lower max_attempts or raise limits.max_turns"
            )
        if self.limits.step_timeout_s < self.sandbox.wall_timeout_s + 2:
            raise ValueError(
                f"limits.step_timeout_s={self.limits.step_timeout_s:g} leaves no room for a sandbox run of up to "
                f"sandbox.wall_timeout_s={self.sandbox.wall_timeout_s:g} s (plus 2 s to start and clean up); "
                "raise step_timeout_s or lower wall_timeout_s"
            )
        return self

    @property
    def attempts(self) -> int:
        """Code answers per episode."""
        return self.max_attempts or self.limits.max_turns


def code_samples(cfg: CodeEnvConfig) -> tuple[list[EnvSample], list[EnvSample]]:
    """(train, held-out): `num_problems` built-in problems (envs/code_problems.py) drawn with the
    seed; the first `eval_fraction` of them held out. Disjoint; `data` holds prompt, solution, tests."""
    samples = [EnvSample(i, p) for i, p in enumerate(draw_problems(cfg.seed, cfg.num_problems))]
    num_eval = max(1, round(cfg.num_problems * cfg.eval_fraction))
    if num_eval >= len(samples):
        raise ValueError(
            f"eval_fraction={cfg.eval_fraction} holds out every problem; lower it or add problems"
        )
    return samples[num_eval:], samples[:num_eval]


def _opening(sample: EnvSample, cfg: CodeEnvConfig) -> list[Message]:
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return [*system, {"role": "user", "content": sample.data["prompt"]}]


def code_demonstration(sample: EnvSample, cfg: CodeEnvConfig) -> list[Message]:
    """The ideal episode for the supervised warm start: the opening messages (as `reset()` gives them)
    and the reference solution in a ```python block."""
    answer = f"```python\n{sample.data['solution']}\n```"
    return [*_opening(sample, cfg), {"role": "assistant", "content": answer}]


# --------------------------------------------------------------------------- checking an answer

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The last fenced code block (```python, ```py or a bare ```; an unclosed last block runs to the
    end of the text, as in a reply cut by its token limit), or None when there is none."""
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


_HARNESS = """\
import json, os, sys, traceback


def _error(e):
    return traceback.format_exception_only(type(e), e)[-1].strip()


def _main(nonce, source, calls, write=os.write, dumps=json.dumps, compile=compile, eval=eval, repr=repr):
    tag = lambda o: {"<object>": repr(o)}
    ns = {"__name__": "solution"}
    report = {"results": []}
    try:
        exec(compile(source, "solution.py", "exec"), ns)
    except BaseException as e:
        report = {"failure": "the code failed: " + _error(e)}
        calls = []
    for call in calls:
        try:
            got = eval(compile(call, "test", "eval"), ns)
            report["results"].append({"value": dumps(got, default=tag), "repr": repr(got)[:200]})
        except BaseException as e:
            report["results"].append({"error": _error(e)})
    write(1, ("\\n" + nonce + " " + dumps(report) + "\\n").encode())


_main(sys.stdin.readline().strip(), SOURCE, CALLS)
"""


@dataclass(frozen=True)
class UnitTest:
    """One `assert CALL == EXPECTED` line of a problem: the call the sandbox evaluates (`call`) and the
    expected value, parsed here from its literal (it never enters the sandbox)."""

    text: str
    call: str
    expected: Any

    @classmethod
    def parse(cls, test: str) -> UnitTest:
        """`test` must read `assert EXPR == LITERAL` (a Python literal: numbers, strings, lists, ...)."""
        node = ast.parse(test).body
        t = node[0].test if len(node) == 1 and isinstance(node[0], ast.Assert) else None
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            try:
                return cls(test, ast.unparse(t.left), ast.literal_eval(t.comparators[0]))
            except ValueError:
                pass
        raise ValueError(
            f"the code test {test!r} is not of the form `assert EXPR == LITERAL`; the harness compares "
            "the value of EXPR with the literal outside the sandbox, so write the expected value out"
        )

    def wanted(self) -> str:
        """The expected value serialized as the harness serializes the value it got."""
        return json.dumps(self.expected, default=_tag)


def _tag(o: Any) -> dict[str, str]:
    return {"<object>": repr(o)}


def harness_program(code: str, tests: list[UnitTest]) -> str:
    """The program the sandbox runs: `code` as solution.py, then the call of each test; it reports one
    line `NONCE {"results": [{"value": JSON, "repr": ...} | {"error": ...}, ...]}` (or `{"failure": ...}`
    when the code itself raised) with the nonce it reads from stdin first. The expected values are not
    in it: the verdict is the parent's (`_verdict`)."""
    return _HARNESS.replace("SOURCE, CALLS)", f"{code!r}, {[t.call for t in tests]!r})")


@dataclass
class Verdict:
    """One attempt's outcome: tests passed of total, the message for the model, the sandbox's kill."""

    passed: int
    total: int
    feedback: str
    killed: Killed | None = None

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _verdict(result: SandboxResult, nonce: str, tests: list[UnitTest], cfg: CodeEnvConfig) -> Verdict:
    sb, total = cfg.sandbox, len(tests)
    stopped = {
        "cpu": f"it used more than {sb.cpu_time_s} s of CPU time (an endless loop?)",
        "memory": f"it ran out of memory ({sb.memory_mb} MB)",
        "output": f"it printed more than {sb.max_output_bytes} bytes",
        "timeout": f"it ran longer than {sb.wall_timeout_s:g} s",
    }
    if result.killed in ("cpu", "timeout", "output"):
        return Verdict(0, total, f"Your code was stopped: {stopped[result.killed]}.", result.killed)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith(nonce + " ")), None)
    if line is None:
        if result.killed == "memory":
            return Verdict(0, total, f"Your code was stopped: {stopped['memory']}.", "memory")
        tail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
        return Verdict(0, total, f"Your code exited before the tests ran: {tail[0]}", None)
    return _score(line[len(nonce) + 1 :], tests)


def _score(report_text: str, tests: list[UnitTest]) -> Verdict:
    """Compare the values the harness reported with the expected ones (computed here, not in the
    sandbox): a test passes when its value serializes as the expected value does."""
    total = len(tests)
    try:
        report = json.loads(report_text)
        results = report.get("results")
        failure = report.get("failure")
        if failure is not None or not isinstance(results, list) or len(results) != total:
            return Verdict(
                0, total, f"0/{total} tests passed. {failure or 'The test report was incomplete.'}"
            )
        passed, first = 0, None
        for test, got in zip(tests, results):
            if "error" in got:
                problem = f"{test.text}: {test.call} raised {got['error']}"
            elif got["value"] == test.wanted():
                passed += 1
                continue
            else:
                problem = f"{test.text}: {test.call} returned {str(got['repr'])[:200]}"
            first = first or problem
    except (ValueError, TypeError, KeyError, AttributeError):
        return Verdict(0, total, f"0/{total} tests passed. The test report was malformed.")
    return Verdict(passed, total, f"{passed}/{total} tests passed. {first or ''}".strip())


class CodeEnvironment(Environment):
    """One problem; see the module docstring. Info at the end: tests_passed_fraction (last attempt),
    sandbox_killed (1 if the sandbox stopped any attempt) and attempts."""

    def __init__(self, sample: EnvSample, cfg: CodeEnvConfig) -> None:
        super().__init__(sample)
        self.cfg = cfg
        self.attempts = 0
        self.any_killed = False

    def reset(self) -> list[Message]:
        return _opening(self.sample, self.cfg)

    async def step(self, message: AssistantMessage) -> EnvStep:
        self.attempts += 1
        verdict = await self.check(message.content)
        self.any_killed |= verdict.killed is not None
        solved = verdict.total > 0 and verdict.passed == verdict.total
        if solved or self.attempts >= self.cfg.attempts:
            info = {
                "tests_passed_fraction": verdict.fraction,
                "sandbox_killed": float(self.any_killed),
                "attempts": float(self.attempts),
            }
            return EnvStep(done=True, reward=1.0 if solved else verdict.fraction, success=solved, info=info)
        return EnvStep([{"role": "user", "content": verdict.feedback[: self.cfg.feedback_chars]}])

    async def check(self, text: str) -> Verdict:
        """Run the reply's code with this problem's tests in the sandbox."""
        tests = [UnitTest.parse(t) for t in self.sample.data["tests"]]
        code = extract_code(text)
        if code is None:
            return Verdict(
                0, len(tests), "No ```python code block found. Answer with a ```python code block."
            )
        nonce = secrets.token_hex(16)
        result = await arun_python(harness_program(code, tests), self.cfg.sandbox, stdin=nonce + "\n")
        return _verdict(result, nonce, tests, self.cfg)
