"""Built-in environment (c): write a small Python function; unit tests in a sandbox give the reward.

The problems (envs/code_problems.py) are generated in code from a few templates with parameters
("Write a Python function f(x) that returns x*3+1", "... the list xs reversed", ...), each with a
one-line reference solution (`code_demonstration` makes it a warm-start episode) and 3-5 asserts.

An episode: the model answers with a ```python block; the last such block is run with the tests in
the sandbox (envs/sandbox.py). All tests pass: done, reward 1. Otherwise the model gets the first
failing assert (or error, or why the sandbox stopped the code) and tries again, up to `max_attempts`;
after the last attempt the reward is the fraction of tests that attempt passed (0 when the sandbox
killed it). A reply without a code block counts as an attempt that passed nothing.

The test harness compares `f(...) == expected` through `json.dumps` (an object whose `__eq__` always
says True does not pass) and reports through a line keyed by a nonce the program reads from stdin
before the solution runs, so printing a fake report does not pass either. It resists simple reward
hacks, not a model that inspects the harness's own frames.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Literal

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
import ast, json, os, sys, traceback


def _error(e):
    return traceback.format_exception_only(type(e), e)[-1].strip()


def _check(test, ns, dumps):
    node = ast.parse(test).body[0]
    t = node.test if isinstance(node, ast.Assert) else None
    if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
        call = ast.unparse(t.left)
        try:
            got = eval(compile(ast.Expression(t.left), "test", "eval"), ns)
        except BaseException as e:
            return f"{test}: {call} raised {_error(e)}"
        want = eval(compile(ast.Expression(t.comparators[0]), "test", "eval"), {})
        tag = lambda o: {"<object>": repr(o)}
        if dumps(got, default=tag) == dumps(want, default=tag):
            return None
        return f"{test}: {call} returned {repr(got)[:200]}"
    try:
        exec(compile(test, "test", "exec"), ns)
    except BaseException as e:
        return f"{test}: {_error(e)}"
    return None


def _main(nonce, source, tests, write=os.write, dumps=json.dumps):
    ns = {"__name__": "solution"}
    report = {"passed": 0, "total": len(tests), "failure": None}
    try:
        exec(compile(source, "solution.py", "exec"), ns)
    except BaseException as e:
        report["failure"] = f"the code failed: {_error(e)}"
        tests = []
    for test in tests:
        problem = _check(test, ns, dumps)
        if problem is None:
            report["passed"] += 1
        elif report["failure"] is None:
            report["failure"] = problem
    write(1, ("\\n" + nonce + " " + dumps(report) + "\\n").encode())


_main(sys.stdin.readline().strip(), SOURCE, TESTS)
"""


def harness_program(code: str, tests: list[str]) -> str:
    """The program the sandbox runs: `code` as solution.py, then each assert in `tests`; it reports
    one line `NONCE {"passed", "total", "failure"}` with the nonce it reads from stdin first."""
    return _HARNESS.replace("SOURCE, TESTS)", f"{code!r}, {tests!r})")


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


def _verdict(result: SandboxResult, nonce: str, total: int, cfg: CodeEnvConfig) -> Verdict:
    sb = cfg.sandbox
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
    report = json.loads(line[len(nonce) + 1 :])
    failure = report["failure"] or ""
    return Verdict(
        int(report["passed"]), total, f"{report['passed']}/{total} tests passed. {failure}".strip()
    )


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
        tests = self.sample.data["tests"]
        code = extract_code(text)
        if code is None:
            return Verdict(
                0, len(tests), "No ```python code block found. Answer with a ```python code block."
            )
        nonce = secrets.token_hex(16)
        result = await arun_python(harness_program(code, tests), self.cfg.sandbox, stdin=nonce + "\n")
        return _verdict(result, nonce, len(tests), self.cfg)
