"""Shared bits of the benchmarks: timing with repeats, medians, the RESULT line format, and child
processes that fail fast.

Fail fast: a benchmark checks its optional dependencies before it starts anything (`require`), starts
its children with `start`, and never waits on them blindly. The parent waits with `watch` (or, while it
is itself blocked in a collective with them, under `watchdog`); any wait on a queue, pipe, event or
semaphore goes through `wait_for`, which retries a short timeout and re-checks the other processes in
between. When a child dies the parent stops the others and exits non-zero within seconds, naming the
child and its exit code, instead of sitting out a long barrier or collective timeout.

Test hook: `BENCH_CHILD_EXIT=<name>:<code>` makes the child called `<name>` exit with `<code>` as soon
as it starts (tests/test_benchmarks_fail_fast.py).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.process import BaseProcess
from pathlib import Path

CHILD_EXIT_ENV = "BENCH_CHILD_EXIT"
STOP_GRACE_S = 5.0  # a stopped child gets this long after SIGTERM before SIGKILL


def time_repeats(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of `fn` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)


def result_line(name: str, value: float, target: str) -> str:
    """The benchmark protocol's last lines: `RESULT <name> <value> target <op><number>`."""
    return f"RESULT {name} {value:.4g} target {target}"


# --------------------------------------------------------------------------- fail fast


class ChildDied(RuntimeError):
    """A child process of a benchmark exited with an error, or before delivering what it owed."""


def require(*modules: str, extra: str = "bench") -> None:
    """Exit non-zero, naming every module in `modules` that cannot be imported and how to install it."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or a broken install failing with anything else
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        sys.exit(
            f"{Path(sys.argv[0]).name} needs {', '.join(missing)}; install it with "
            f'pip install -e ".[{extra}]"'
        )


def describe_exit(code: int | None) -> str:
    """`exit code 3`, `killed by SIGKILL (exit code -9)` or `still running`."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exit code {code}"


def _child_main(name: str, fn: Callable[..., object], args: tuple) -> None:
    hook = os.environ.get(CHILD_EXIT_ENV, "")
    if hook.rpartition(":")[0] == name:
        os._exit(int(hook.rpartition(":")[2]))
    fn(*args)


def start(ctx, children: Mapping[str, tuple[Callable[..., object], tuple]]) -> dict[str, BaseProcess]:
    """Start one process of `ctx` per entry `name: (fn, args)`, each calling `fn(*args)`."""
    procs = {
        name: ctx.Process(target=_child_main, args=(name, fn, args), name=name)
        for name, (fn, args) in children.items()
    }
    try:
        for p in procs.values():
            p.start()
    except BaseException:
        stop({n: p for n, p in procs.items() if p.pid is not None})
        raise
    return procs


def stop(procs: Mapping[str, BaseProcess]) -> None:
    """Terminate every child still running; kill those that outlive `STOP_GRACE_S`."""
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs.values():
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=STOP_GRACE_S)


def _failure(procs: Mapping[str, BaseProcess], dead_ok: bool) -> str | None:
    """A message naming the first child that failed (exited non-zero, or at all unless `dead_ok`)."""
    for name, p in procs.items():
        code = p.exitcode
        if code is not None and (code != 0 or not dead_ok):
            others = [n for n, q in procs.items() if n != name and q.exitcode is None]
            also = f"; stopping {', '.join(others)}" if others else ""
            return f"the {name} process exited ({describe_exit(code)}){also}"
    return None


def watch(
    procs: Mapping[str, BaseProcess], abort=None, poll_s: float = 1.0, timeout_s: float | None = None
) -> None:
    """Wait until every child has exited cleanly. When one exits non-zero (or `timeout_s` passes): set
    `abort` (an Event the others poll in `wait_for`), stop the others and raise `ChildDied`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            failure = _failure(procs, dead_ok=True)
            if failure:
                raise ChildDied(failure)
            running = [p.sentinel for p in procs.values() if p.exitcode is None]
            if not running:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise ChildDied(f"the children did not finish within {timeout_s:.0f}s")
            multiprocessing.connection.wait(running, timeout=poll_s)  # returns as soon as one exits
    except BaseException:
        if abort is not None:
            abort.set()
        stop(procs)
        raise


def wait_for(
    ready: Callable[[float], bool],
    what: str,
    *,
    timeout_s: float,
    procs: Mapping[str, BaseProcess] | None = None,
    abort=None,
    poll_s: float = 0.5,
) -> None:
    """Call `ready(poll_s)` (a bounded `acquire`, `poll` or `Event.wait`) until it returns True.

    Between tries it raises `ChildDied` when a process in `procs` has exited (it will never deliver),
    when `abort` is set, or, in a child, when the parent has died; `TimeoutError` after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    parent = mp.parent_process()
    while not ready(poll_s):
        failure = _failure(procs or {}, dead_ok=False)
        if failure:
            if ready(0):  # it delivered, then exited
                return
            raise ChildDied(f"{failure} while waiting for {what}")
        if abort is not None and abort.is_set():
            raise ChildDied(f"another process died while this one waited for {what}")
        if parent is not None and not parent.is_alive():
            raise ChildDied(f"the parent process died while this one waited for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")


@contextlib.contextmanager
def watchdog(procs: Mapping[str, BaseProcess], poll_s: float = 0.5) -> Iterator[None]:
    """While the body runs, a thread watches `procs`: when one exits non-zero it stops the others and
    ends this process with status 1 and the message of `watch`. For a parent blocked in a collective or
    rendezvous with its children, which would otherwise wait for a dead one until its timeout."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(poll_s):
            failure = _failure(procs, dead_ok=True)
            if failure:
                stop(procs)
                print(f"{Path(sys.argv[0]).name}: {failure}", file=sys.stderr, flush=True)
                os._exit(1)  # the main thread may be blocked in C code; nothing else ends it promptly

    thread = threading.Thread(target=run, name="benchmark-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def same_host_memory() -> str | None:
    """Put this process on posttrain's host-memory policy (posttrain/host_memory.py: freed memory is kept
    for reuse, unless POSTTRAIN_HOST_MALLOC=release). posttrain's CPU workers and engines apply it to
    their process, so every benchmark process applies it before any side runs, the references' included:
    no ratio credits posttrain with the allocator. Returns the mode (None: not glibc)."""
    from posttrain.host_memory import keep_freed_memory

    return keep_freed_memory()


def run_main(main: Callable[[], None]) -> None:
    """Run a benchmark's `main` (in this process's `same_host_memory`); a dead child ends it with
    status 1 and one line naming the child."""
    same_host_memory()
    try:
        main()
    except ChildDied as e:
        sys.exit(f"{Path(sys.argv[0]).name}: {e}")
