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
it, only the call of each test (`f(3)`, never the expected value); it prints, on one line keyed by a
nonce it reads from stdin before the solution runs, each call's value as Python literal text when
the value is built only of plain values (None, bool, int, float, complex, str, bytes and tuples,
lists, dicts, sets and frozensets of them: these exact types, checked recursively), else only that
it is not (that test fails). The trainer's process parses the asserts, takes the expected values from
their literals, reads each reported literal back with `ast.literal_eval` and compares with `==`: the
verdict is Python's (`1 == True`, `2 == 2.0`, dicts and sets in any order; `(1, 2) != [1, 2]`) and no
code of the solution runs in the trainer. An object whose `__eq__` always says True passes nothing,
and so does a solution that rewrites the harness, `builtins` or `json` in its interpreter; all it
controls is the values it reports, which must be the right ones.
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


_MAX_REPR = 4000  # characters of a returned value's literal the harness reports; a longer one fails its test

_HARNESS = """\
import json, os, sys, traceback


def _error(e):
    return traceback.format_exception_only(type(e), e)[-1].strip()


def _show(o, repr=repr):
    try:
        return repr(o)[:200]
    except BaseException as e:
        return "an object whose repr raised " + _error(e)


class _NotLiteral(Exception):
    pass


def _float(x, repr=repr):
    if x != x:
        raise _NotLiteral("nan")
    return repr(x) if x - x == 0 else ("1e999" if x > 0 else "-1e999")


def _literal(o, inside, type=type, id=id, len=len, repr=repr):
    t = type(o)
    if o is None or t is bool or t is int or t is str or t is bytes:
        return repr(o)
    if t is float:
        return _float(o)
    if t is complex:
        i = _float(o.imag)
        return "(" + _float(o.real) + (i if i[0] == "-" else "+" + i) + "j)"
    if t is not tuple and t is not list and t is not dict and t is not set and t is not frozenset:
        raise _NotLiteral("type")
    if id(o) in inside:
        raise _NotLiteral("cycle")
    inside.add(id(o))
    if t is dict:
        items = [_literal(k, inside) + ": " + _literal(v, inside) for k, v in o.items()]
    else:
        items = [_literal(x, inside) for x in o]
    inside.discard(id(o))
    text = ", ".join(items)
    if t is tuple:
        return "(" + text + ("," if len(items) == 1 else "") + ")"
    if t is list:
        return "[" + text + "]"
    return "{" + text + "}" if items or t is dict else "set()"


def _main(nonce, source, calls, limit, write=os.write, dumps=json.dumps, compile=compile, eval=eval,
          set=set, len=len, literal=_literal, show=_show, NotLiteral=_NotLiteral):
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
        except BaseException as e:
            report["results"].append({"error": _error(e)})
            continue
        try:
            text = literal(got, set())
            result = {"value": text} if len(text) <= limit else {"other": text[:200], "why": "size"}
        except NotLiteral as e:
            result = {"other": show(got), "why": e.args[0]}
        except BaseException:  # nested past the recursion limit, an int too long to print, ...
            result = {"other": show(got), "why": "size"}
        report["results"].append(result)
    write(1, ("\\n" + nonce + " " + dumps(report) + "\\n").encode())


_main(sys.stdin.readline().strip(), SOURCE, CALLS, LIMIT)
"""

# why the harness could not report a value as a literal (its "why"), as the model is told
_NOT_LITERAL = {
    "type": "not a value built only of None, bool, int, float, complex, str, bytes and tuples, lists, "
    "dicts and sets of them (the only values the tests compare)",
    "nan": "a value holding a float nan (equal to nothing)",
    "cycle": "a value that contains itself",
    "size": f"a value too large to report (its literal is over {_MAX_REPR} characters or nested too deeply)",
}


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
                expected = ast.literal_eval(t.comparators[0])
            except ValueError:
                pass
            else:
                if len(repr(expected)) > _MAX_REPR // 2:
                    raise ValueError(
                        f"the expected value of the code test {test[:100]!r}... is longer than "
                        f"{_MAX_REPR // 2} characters; the harness reports values up to {_MAX_REPR}"
                    )
                return cls(test, ast.unparse(t.left), expected)
        raise ValueError(
            f"the code test {test!r} is not of the form `assert EXPR == LITERAL`; the harness compares "
            "the value of EXPR with the literal outside the sandbox, so write the expected value out"
        )

    def passes(self, literal: str) -> bool:
        """Whether the value the harness reported (its literal text) equals the expected value, as
        Python's `==` says: both are plain values (ast.literal_eval), so no code of the solution runs."""
        if len(literal) > _MAX_REPR:  # (the harness reports none longer: a forged report)
            return False
        try:
            return bool(ast.literal_eval(literal) == self.expected)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False  # (e.g. a set in a set: a value no literal expected value can equal)


def harness_program(code: str, tests: list[UnitTest]) -> str:
    """The program the sandbox runs: `code` as solution.py, then the call of each test; it reports one
    line `NONCE {"results": [{"value": LITERAL} | {"other": REPR, "why": ...} | {"error": ...}, ...]}`
    (or `{"failure": ...}` when the code itself raised) with the nonce it reads from stdin first. A
    value is reported as Python literal text (`ast.literal_eval` reads it back) only when it is built
    of plain values (None, bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset:
    exactly these types, not subclasses); anything else as "other", which fails its test. The
    expected values are not in it: the verdict is the parent's (`_verdict`)."""
    calls = [t.call for t in tests]
    return _HARNESS.replace("SOURCE, CALLS, LIMIT)", f"{code!r}, {calls!r}, {_MAX_REPR})")


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
    """Compare the values the harness reported with the expected ones (parsed here, never in the
    sandbox): a test passes when its reported literal equals the expected value (`UnitTest.passes`)."""
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
            elif "value" in got and isinstance(got["value"], str):
                if test.passes(got["value"]):
                    passed += 1
                    continue
                problem = f"{test.text}: {test.call} returned {got['value'][:200]}"
            else:
                why = _NOT_LITERAL.get(got.get("why"), _NOT_LITERAL["type"])
                problem = f"{test.text}: {test.call} returned {str(got['other'])[:200]}, {why}"
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
