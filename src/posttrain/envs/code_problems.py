"""The built-in problem set of the code environment (envs/code.py), generated in code.

A few templates with parameters ("Write a Python function f(x) that returns x*3+1", "... the list xs
reversed", ...); each problem has a one-line reference solution and 3-5 asserts whose expected values
come from a separate Python definition of the task, so running every reference solution against its
tests (tests/test_sandbox.py) checks that statements, solutions and tests agree. Texts are ASCII,
within the tiny character-level chat tokenizer's alphabet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class _Template:
    """A family of problems: `task` and `body` are formatted with each point of `grid`; `want(p, *args)`
    is the answer computed in Python; `inputs(rng, p)` draws the test arguments (distinct tuples)."""

    signature: str
    task: str
    body: str
    grid: list[dict[str, Any]]
    want: Callable[..., Any]
    inputs: Callable[[np.random.Generator, dict[str, Any]], list[tuple]]


def _ints(lo: int, hi: int) -> Callable[[np.random.Generator, dict], list[tuple]]:
    return lambda rng, p: [(int(v),) for v in rng.choice(np.arange(lo, hi), 5, replace=False)]


def _multiples(rng: np.random.Generator, p: dict) -> list[tuple]:
    k = p["k"]
    hits = [k * int(m) for m in rng.choice(np.arange(1, 12), 2, replace=False)]
    misses = [
        k * int(m) + int(r)
        for m, r in zip(rng.choice(np.arange(0, 12), 3, replace=False), rng.integers(1, k, 3))
    ]
    return [(v,) for v in hits + misses]


def _pairs(rng: np.random.Generator, p: dict) -> list[tuple]:
    a, b = rng.choice(np.arange(-20, 21), (2, 5), replace=False)
    return [(int(x), int(y)) for x, y in zip(a, b)]


def _lists(rng: np.random.Generator, p: dict) -> list[tuple]:
    return [([int(v) for v in rng.integers(0, 10, int(rng.integers(1, 7)))],) for _ in range(5)]


def _strings(rng: np.random.Generator, p: dict) -> list[tuple]:
    letters = list(dict.fromkeys(p.get("c", "") + "abcde"))[:5]
    return [("".join(rng.choice(letters, int(rng.integers(1, 7)))),) for _ in range(5)]


def _grid(**axes: range | list) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = [{}]
    for key, values in axes.items():
        points = [{**p, key: v} for p in points for v in values]
    return points


_TEMPLATES = [
    _Template(
        "f(x)",
        "returns x*{a}+{b}",
        "return x*{a}+{b}",
        _grid(a=range(2, 10), b=range(1, 10)),
        lambda p, x: x * p["a"] + p["b"],
        _ints(-20, 60),
    ),
    _Template(
        "f(x)",
        "returns x*x+{b}",
        "return x*x+{b}",
        _grid(b=range(1, 10)),
        lambda p, x: x * x + p["b"],
        _ints(-12, 13),
    ),
    _Template(
        "f(x)",
        "returns the remainder of x divided by {m}",
        "return x%{m}",
        _grid(m=range(2, 10)),
        lambda p, x: x % p["m"],
        _ints(0, 100),
    ),
    _Template(
        "f(x)",
        "returns True if x is divisible by {k}, else False",
        "return x%{k}==0",
        _grid(k=range(2, 10)),
        lambda p, x: x % p["k"] == 0,
        _multiples,
    ),
    _Template(
        "f(x)",
        "returns the sum of the digits of x (x >= 0)",
        "return sum(int(c) for c in str(x))",
        [{}],
        lambda p, x: sum(int(c) for c in str(x)),
        _ints(0, 1000),
    ),
    _Template(
        "f(a, b)",
        "returns the {which} of a and b",
        "return {fn}(a,b)",
        [{"which": "larger", "fn": "max"}, {"which": "smaller", "fn": "min"}],
        lambda p, a, b: max(a, b) if p["fn"] == "max" else min(a, b),
        _pairs,
    ),
    _Template(
        "f(a, b)",
        "returns the absolute difference of a and b",
        "return abs(a-b)",
        [{}],
        lambda p, a, b: abs(a - b),
        _pairs,
    ),
    _Template(
        "f(xs)", "returns the list xs reversed", "return xs[::-1]", [{}], lambda p, xs: xs[::-1], _lists
    ),
    _Template(
        "f(xs)",
        "returns the list of each element of xs times {k}",
        "return [v*{k} for v in xs]",
        _grid(k=range(2, 10)),
        lambda p, xs: [v * p["k"] for v in xs],
        _lists,
    ),
    _Template(
        "f(xs)",
        "returns the first {n} elements of the list xs",
        "return xs[:{n}]",
        _grid(n=range(1, 5)),
        lambda p, xs: xs[: p["n"]],
        _lists,
    ),
    _Template(
        "f(xs)",
        "returns the sum of the list xs plus {b}",
        "return sum(xs)+{b}",
        _grid(b=range(1, 10)),
        lambda p, xs: sum(xs) + p["b"],
        _lists,
    ),
    _Template(
        "f(xs)",
        "returns how many elements of xs are greater than {t}",
        "return len([v for v in xs if v>{t}])",
        _grid(t=range(1, 9)),
        lambda p, xs: len([v for v in xs if v > p["t"]]),
        _lists,
    ),
    _Template(
        "f(s)",
        "returns how many times the letter {c} occurs in the string s",
        "return s.count('{c}')",
        _grid(c=list("abcdefghijklmnopqrstuvwxyz")),
        lambda p, s: s.count(p["c"]),
        _strings,
    ),
    _Template(
        "f(s)",
        "returns the string s repeated {n} times",
        "return s*{n}",
        _grid(n=range(2, 6)),
        lambda p, s: s * p["n"],
        _strings,
    ),
    _Template(
        "f(s)",
        "returns the string s in upper case",
        "return s.upper()",
        [{}],
        lambda p, s: s.upper(),
        _strings,
    ),
]


def _problem(template: _Template, p: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """The sample fields of one problem: statement, reference solution, assert lines."""
    drawn = template.inputs(rng, p)
    args = [a for i, a in enumerate(drawn) if a not in drawn[:i]]  # distinct, in order
    args = args[: int(rng.integers(3, 6))]
    name = template.signature.split("(")[0]
    tests = [f"assert {name}({', '.join(map(repr, a))}) == {template.want(p, *a)!r}" for a in args]
    task = template.task.format(**p)
    return {
        "prompt": f"Write a Python function {template.signature} that {task}. Answer with a ```python code block.",
        "solution": f"def {template.signature}:\n    {template.body.format(**p)}",
        "tests": tests,
    }


def draw_problems(seed: int, num: int) -> list[dict[str, Any]]:
    """`num` distinct problems (fields prompt, solution, tests), drawn round-robin over the templates
    (each template's parameters in a seeded order) and shuffled; their tests drawn with the seed."""
    rng = np.random.default_rng(seed)
    queues = [[(t, t.grid[i]) for i in rng.permutation(len(t.grid))] for t in _TEMPLATES]
    picked: list[tuple[_Template, dict]] = []
    while len(picked) < num and any(queues):
        for queue in queues:
            if queue and len(picked) < num:
                picked.append(queue.pop(0))
    if len(picked) < num:
        raise ValueError(
            f"{num} problems asked for, but there are {len(picked)} built-in ones; ask for fewer"
        )
    return [_problem(*picked[j], np.random.default_rng([seed, int(j)])) for j in rng.permutation(num)]


NUM_BUILTIN_PROBLEMS = sum(len(t.grid) for t in _TEMPLATES)
