"""math-verify's scoring (`MathVerifyScorer`), and the same in a child process for rewards computed off
the main thread (`MathVerifyChild`).

math-verify bounds its work with `signal.alarm`, which only the main thread can use. Off it (the async
rollout worker scores on a daemon thread) it would run unbounded, and a completion such as
`\\boxed{9^{9^{9}}}` makes sympy compute a number of hundreds of millions of digits in C while holding
the GIL: the whole process (event loop, engine, every thread) freezes for minutes and its memory grows
by gigabytes. So off the main thread the reward runs here instead: one persistent child process
(`main` in a fresh interpreter, started on first use, no fork of the caller) scores one sample
at a time in its own main thread, where math-verify's timeouts work, and this side waits for each answer
at most `bound` seconds (three math-verify timeouts: the gold answer's parse, the completion's, the
comparison; plus slack). A child that does not answer in time (a computation the signal cannot
interrupt) is killed: that sample is marked failed with the reason, and a fresh child scores the rest.
A child that dies is handled the same way. The child ends when this process closes its stdin, which
the OS does when this process dies however it dies (a child inside a computation finishes that first;
PR_SET_PDEATHSIG would not do: it fires when the thread that started the child ends, and scoring
threads come and go).

Protocol: one JSON line per sample each way: {"completion", "answer"} in, {"reward", "error"} out; the
child prints "ready" once math-verify is imported.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from posttrain.tasks.datasets import answer_text

STARTUP_S = 120.0  # for the child to import math-verify (and sympy) and say it is ready
SLACK_S = 5.0  # past the child's own timeouts, before this side gives up on a sample

_GOLD_CACHE_SIZE = 100_000
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def import_math_verify() -> tuple[Any, type]:
    """The math_verify module and its timeout exception (ValueError naming the install otherwise)."""
    try:
        import math_verify
        from math_verify.errors import TimeoutException
    except ImportError as exc:
        raise ValueError(
            "the math task needs math-verify: pip install 'posttrain[math]' (or pip install math-verify)"
        ) from exc
    return math_verify, TimeoutException


class MathVerifyScorer:
    """math-verify's verdict on one completion against a gold answer, each parse and the comparison
    bounded by `timeout_seconds` (signal-based: in a main thread only). Gold answers are parsed once."""

    def __init__(self, timeout_seconds: int, float_rounding: int) -> None:
        self.mv, self.timeout_exc = import_math_verify()
        self.timeout_seconds = timeout_seconds
        self.float_rounding = float_rounding
        self._gold: dict[str, list[Any]] = {}

    def _parse_gold(self, answer: str) -> list[Any]:
        if answer not in self._gold:
            # written for a LaTeX reader already: an unescaped '$' (not a currency sign '\$') or \boxed{}
            text = answer if _UNESCAPED_DOLLAR.search(answer) or "\\boxed" in answer else f"${answer}$"
            parsed = self.mv.parse(text, parsing_timeout=self.timeout_seconds, raise_on_error=True)
            if all(isinstance(x, str) for x in parsed):  # empty, or only the unparsed text as a fallback
                raise ValueError(f"math-verify cannot parse the gold answer {answer!r}")
            if len(self._gold) >= _GOLD_CACHE_SIZE:
                self._gold.clear()
            self._gold[answer] = parsed
        return self._gold[answer]

    def score_one(self, completion: str, answer: Any) -> float:
        """1.0 or 0.0; raises when math-verify fails or times out."""
        gold = self._parse_gold(answer_text(answer))
        timeout = self.timeout_seconds
        pred = self.mv.parse(completion, parsing_timeout=timeout, raise_on_error=True)
        ok = self.mv.verify(
            gold, pred, float_rounding=self.float_rounding, timeout_seconds=timeout, raise_on_error=True
        )
        return 1.0 if ok else 0.0


_LIVE: weakref.WeakSet[MathVerifyChild] = weakref.WeakSet()


@atexit.register
def _stop_children() -> None:
    for child in list(_LIVE):
        child.close()


class MathVerifyChild:
    """Scores (completion, gold answer text) pairs with math-verify in a watched child process; see the
    module docstring. Thread-safe (calls are served one at a time)."""

    def __init__(self, timeout_seconds: int, float_rounding: int, argv: list[str] | None = None) -> None:
        entry = "import sys; from posttrain.tasks.math_child import main; main(sys.argv[1:])"
        self.argv = argv or [sys.executable, "-c", entry, str(timeout_seconds), str(float_rounding)]
        self.bound = 3 * timeout_seconds + SLACK_S
        self.kills = 0  # children killed for not answering in time
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        _LIVE.add(self)

    def score(self, pairs: list[tuple[str, str]]) -> list[tuple[float, str | None]]:
        """(reward, error) per pair, in order: reward 1.0 / 0.0 with error None, or NaN with the reason
        the sample could not be scored."""
        with self._lock:
            return [self._score_one(completion, answer) for completion, answer in pairs]

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc)

    def _score_one(self, completion: str, answer: str) -> tuple[float, str | None]:
        proc = self._ready()
        try:
            proc.stdin.write((json.dumps({"completion": completion, "answer": answer}) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._lost(proc, "math-verify's process died before taking the sample")
        line = self._read_line(proc, self.bound)
        if line is None:
            self.kills += 1
            return self._lost(
                proc,
                f"TimeoutError: math-verify gave no answer within {self.bound:.0f} s (a computation its own "
                "timeout cannot interrupt); its process was killed and a new one scores the rest",
            )
        if not line:
            return self._lost(proc, f"math-verify's process died (exit code {proc.wait()})")
        try:
            out = json.loads(line)
            return (float("nan"), out["error"]) if out["error"] is not None else (float(out["reward"]), None)
        except (ValueError, KeyError, TypeError):  # not its answer: every later line would be one off
            return self._lost(proc, f"math-verify's process answered {line[:200]!r}, not a result; restarted")

    def _lost(self, proc: subprocess.Popen, error: str) -> tuple[float, str | None]:
        """The sample failed with `error`; the child is killed (the next sample starts a new one)."""
        if proc is self._proc:
            self.close()
        return float("nan"), error

    def _ready(self) -> subprocess.Popen:
        """The running child, started (and waited for) when there is none."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.close()
        # its own session: a Ctrl-C at the terminal (a graceful stop of the run) does not reach it; the
        # parent's import path, so it imports the posttrain the parent runs
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, env=env
        )
        try:
            line = self._read_line(proc, STARTUP_S)
        except BaseException:
            _end(proc)
            raise
        if line != b"ready\n":
            _end(proc)
            why = (
                "did not start in time"
                if line is None
                else f"printed {line[:200]!r} instead of 'ready'"
                if line
                else f"exited (code {proc.returncode})"
            )
            raise RuntimeError(
                f"math-verify's scoring process {why} ({shlex.join(self.argv)}); run that command to see "
                "why (math-verify installed? pip install 'posttrain[math]')"
            )
        self._proc = proc  # only once it is ready
        return proc

    @staticmethod
    def _read_line(proc: subprocess.Popen, timeout: float) -> bytes | None:
        """The child's next line (b"" when it closed its output), or None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        poller = select.poll()  # not select.select: it refuses descriptors past 1023
        poller.register(proc.stdout, select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if poller.poll(left * 1000):
                return proc.stdout.readline()


def _end(proc: subprocess.Popen) -> None:
    """Kill a child (if it still runs), reap it and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            pipe.close()


def main(argv: list[str]) -> None:
    """The child's side: score each sample read from stdin in this (main) thread, answer on stdout."""
    # math-verify's timeouts are SIGALRM: the mask inherited from the thread that started this process
    # must not block it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    out, sys.stdout = sys.stdout, sys.stderr  # the protocol alone on stdout; anything printed goes to stderr
    scorer = MathVerifyScorer(int(argv[0]), int(argv[1]))
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = {"reward": scorer.score_one(request["completion"], request["answer"]), "error": None}
        except (Exception, scorer.timeout_exc) as exc:
            result = {"reward": None, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(result) + "\n")
        out.flush()
