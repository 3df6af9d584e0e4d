"""The Python sandbox (limits, no network, cleanup, platform errors, async runs) and the built-in code
environment on it (rewards, feedback, kills, a consistent problem set)."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import subprocess_env
from posttrain.envs import sandbox
from posttrain.envs.base import AssistantMessage, EnvLimits, EnvSample, EnvStep
from posttrain.envs.build import EnvSuite, build_env
from posttrain.envs.code import (
    CodeEnvConfig,
    CodeEnvironment,
    UnitTest,
    code_demonstration,
    code_samples,
    extract_code,
    harness_program,
)
from posttrain.envs.code_problems import NUM_BUILTIN_PROBLEMS
from posttrain.envs.sandbox import (
    SandboxConfig,
    SandboxUnavailableError,
    arun_python,
    check_sandbox,
    run_python,
)
from posttrain.models.tokenizer import CHAT_CHARS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox runs on Linux")


def _isolation_problem() -> str | None:
    try:
        check_sandbox(SandboxConfig())
    except SandboxUnavailableError as e:
        return str(e)
    return None


ISOLATION_PROBLEM = _isolation_problem() if sys.platform.startswith("linux") else "not Linux"
needs_isolation = pytest.mark.skipif(ISOLATION_PROBLEM is not None, reason=str(ISOLATION_PROBLEM))
# without user namespaces here, everything that does not test the isolation runs with network: allow
FAST = SandboxConfig(
    cpu_time_s=1,
    memory_mb=256,
    max_output_bytes=64 * 1024,
    wall_timeout_s=20,
    network="allow" if ISOLATION_PROBLEM else "isolate",
)


# --------------------------------------------------------------------------- sandbox


def test_a_plain_program_runs_and_gets_its_stdin():
    r = run_python("import sys; print(sys.stdin.read()[::-1]); print('err', file=sys.stderr)", FAST, "abc")
    assert r.ok and r.stdout == "cba\n" and r.stderr == "err\n" and r.killed is None and not r.truncated
    r = run_python("import sys; sys.exit(3)", FAST)
    assert r.exit_code == 3 and r.killed is None and not r.ok


def test_runaway_loop_is_killed_by_the_cpu_limit():
    r = run_python("while True: pass", FAST)
    assert r.killed == "cpu" and r.exit_code < 0
    # a program that ignores SIGXCPU meets the hard limit (SIGKILL), still told apart as "cpu"
    r = run_python("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass", FAST)
    assert r.killed == "cpu" and r.exit_code == -9


def test_memory_is_capped():
    r = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", FAST)
    assert "allocated" not in r.stdout
    assert "MemoryError" in r.stderr or r.killed == "memory"
    assert r.killed == "memory"


@needs_isolation
def test_network_is_refused_and_only_a_down_loopback_exists():
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(1)
    port = host.getsockname()[1]
    code = f"""
import socket
for addr in [("1.1.1.1", 53), ("127.0.0.1", {port})]:
    try:
        socket.create_connection(addr, timeout=2)
        print("connected", addr)
    except OSError as e:
        print("refused", addr, e.errno)
print([name for _, name in socket.if_nameindex()])
"""
    r = run_python(code, FAST)
    assert r.ok, r.stderr
    assert "connected" not in r.stdout and r.stdout.count("refused") == 2
    assert r.stdout.splitlines()[-1] == "['lo']"
    assert "101" in r.stdout  # ENETUNREACH: even loopback is down inside
    host.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing ever reached the host's listener
        host.accept()
    host.close()


def test_output_is_capped_and_the_program_killed():
    r = run_python("print('x' * 10_000_000)", FAST)
    assert r.killed == "output" and r.truncated
    assert len(r.stdout) == FAST.max_output_bytes and set(r.stdout) == {"x"}


def test_temp_dir_is_removed_and_the_parent_environment_is_not_seen(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SANDBOX_SECRET", "hunter2")
    code = """
import json, os
os.mkdir("locked")
open("locked/file", "w").write("x")
os.chmod("locked", 0)
os.symlink("/", "root_link")
print(json.dumps({"cwd": os.getcwd(), "env": dict(os.environ)}))
os.chmod(".", 0)
"""
    r = run_python(code, FAST)
    assert r.ok, r.stderr
    seen = json.loads(r.stdout)
    assert "hunter2" not in r.stdout and set(seen["env"]) <= {"PATH", "LANG", "LC_CTYPE"}
    assert seen["cwd"].startswith(tempfile.gettempdir()) and not os.path.exists(seen["cwd"])


def test_wall_timeout_kills_a_sleeping_program():
    r = run_python("import time; time.sleep(60)", FAST.model_copy(update={"wall_timeout_s": 1}))
    assert r.killed == "timeout" and r.exit_code == -9


@needs_isolation
def test_processes_that_leave_the_group_die_with_the_run():
    # the grandchild keeps stdout open: were it alive, the run would end at the wall timeout instead
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('main done')"
    r = run_python(code, FAST)
    assert r.ok and r.stdout == "main done\n" and r.killed is None


def _tree(root: int) -> dict[int, str]:
    """The live descendants of process `root`: pid -> start time (a reused pid has another)."""
    stats = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            if fields[0] not in "ZX":  # zombies are dead, only not yet reaped
                stats[int(entry)] = (int(fields[1]), fields[19])
    tree, grew = {}, True
    while grew:
        found = {
            pid: start for pid, (ppid, start) in stats.items() if ppid in {root, *tree} and pid not in tree
        }
        tree.update(found)
        grew = bool(found)
    return tree


def _still_alive(tree: dict[int, str]) -> list[int]:
    alive = []
    for pid, start in tree.items():
        with contextlib.suppress(OSError, IndexError):
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            if fields[0] not in "ZX" and fields[19] == start:
                alive.append(pid)
    return alive


@pytest.mark.parametrize("network", ["isolate", "allow"])
def test_a_run_dies_with_a_killed_parent(network):
    if network == "isolate" and ISOLATION_PROBLEM:
        pytest.skip(ISOLATION_PROBLEM)
    code = "import time\ntime.sleep(600)"
    script = (
        "from posttrain.envs.sandbox import SandboxConfig, run_python\n"
        f"run_python({code!r}, SandboxConfig(wall_timeout_s=600, network={network!r}))"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], env=subprocess_env())
    try:
        for _ in range(600):  # until the program runs (bounded: the loop fails the test below)
            tree = _tree(parent.pid)
            programs = [
                p for p in tree if open(f"/proc/{p}/cmdline").read().split("\0")[-2:] == ["main.py", ""]
            ]
            if programs:
                break
            time.sleep(0.05)
        assert programs, "the sandboxed program never started"
        workdir = os.readlink(f"/proc/{programs[0]}/cwd")
    finally:
        parent.kill()  # SIGKILL: no chance to clean up
        parent.wait()
    for _ in range(600):
        if not _still_alive(tree):
            break
        time.sleep(0.05)
    left = _still_alive(tree)
    for pid in left:  # do not leak them into the rest of the session
        os.kill(pid, 9)
    shutil.rmtree(workdir, ignore_errors=True)  # the parent had no time to remove it
    assert len(tree) == (3 if network == "isolate" else 2) and not left


PIDS_CGROUP = sandbox._pids_parent() if sys.platform.startswith("linux") else "not Linux"
FORKS = """
import os, sys, time
n = 0
for i in range(24):
    try:
        pid = os.fork()
    except BlockingIOError:
        break
    if pid == 0:  # a child that leaves the group and lets the run end, as one meant to outlive it would
        os.setsid()
        for fd in (0, 1, 2):
            os.close(fd)
        time.sleep(60)
        os._exit(0)
    n += 1
print(n, pid)
"""


@pytest.mark.skipif(isinstance(PIDS_CGROUP, str), reason=str(PIDS_CGROUP))
@pytest.mark.parametrize("network", ["isolate", "allow"])
def test_max_processes_bounds_the_programs_processes_and_none_outlives_the_run(network):
    if network == "isolate" and ISOLATION_PROBLEM:
        pytest.skip(ISOLATION_PROBLEM)
    cfg = FAST.model_copy(update={"network": network})
    r = run_python(FORKS, cfg.model_copy(update={"max_processes": 6}))
    forks, last = map(int, r.stdout.split())
    assert r.ok and forks == 5  # the program and 5 children
    for _ in range(
        200 if network == "allow" else 0
    ):  # (isolated, the PID namespace took them: pid ns-local)  # the run's cgroup is killed and removed as the run ends (poll: they die async)
        if (
            not os.path.exists(f"/proc/{last}")
            or open(f"/proc/{last}/stat").read().split(")")[1].split()[0] in "ZX"
        ):
            break
        time.sleep(0.05)
    else:
        assert network == "isolate", f"the forked child {last} outlived the run"
    assert not [d for d in os.listdir(PIDS_CGROUP) if d.startswith("posttrain-sandbox-")]
    r = run_python(FORKS.replace("time.sleep(60)", "time.sleep(0)"), cfg)
    assert r.stdout.split()[0] == "24"  # unbounded without it


def test_max_processes_without_a_pids_cgroup_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(sandbox, "_pids_parent", lambda: "no cgroup with the pids controller")
    with pytest.raises(
        SandboxUnavailableError, match="max_processes=8 needs a cgroup pids controller.*unset"
    ):
        run_python("print(1)", FAST.model_copy(update={"max_processes": 8}))
    assert run_python("print(1)", FAST).stdout == "1\n"


@pytest.fixture(params=["this machine's", "stand-in"])
def pids_parent(request, monkeypatch, tmp_path) -> Path:
    """Where runs make their pids cgroups: this machine's pids cgroup (where this process may manage
    one), or a plain directory standing in for one (its probe cgroups get a pids.max file; cgroups
    are removed as the directories they then are)."""
    if request.param == "this machine's":
        if isinstance(PIDS_CGROUP, str):
            pytest.skip(PIDS_CGROUP)
        return PIDS_CGROUP
    mkdtemp = tempfile.mkdtemp

    def make(**kw):
        made = mkdtemp(**kw)
        if kw.get("prefix") == "posttrain-probe-":
            open(os.path.join(made, "pids.max"), "w").close()
        return made

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", make)
    monkeypatch.setattr(sandbox, "_remove_cgroup", shutil.rmtree)
    return tmp_path


def failing_write(monkeypatch, name: str) -> None:
    """Writing a file called `name` fails as it does without the permission (EACCES)."""
    write_text = Path.write_text

    def write(self, *args, **kwargs):
        if self.name == name:
            raise PermissionError(13, "Permission denied", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write)


def cgroups_left(parent: Path) -> list[str]:
    return [d for d in os.listdir(parent) if d.startswith(("posttrain-probe-", "posttrain-sandbox-"))]


@pytest.mark.parametrize(
    "name, why", [("pids.max", "cannot set pids.max"), ("cgroup.procs", "cannot move a process into")]
)
def test_the_pids_probe_sets_up_and_joins_a_cgroup_and_refuses_one_it_cannot(
    pids_parent, monkeypatch, name, why
):
    assert sandbox._probe_pids(pids_parent) is None and not cgroups_left(pids_parent)
    failing_write(monkeypatch, name)
    problem = sandbox._probe_pids(pids_parent)
    assert problem is not None and why in problem and "Permission denied" in problem
    assert not cgroups_left(pids_parent)  # the probe cleans up after itself, also when it fails
    if pids_parent == PIDS_CGROUP:  # the whole probe, from /proc: refused with the reason and the fix
        monkeypatch.setattr(sandbox, "_pids_parent", sandbox._pids_parent.__wrapped__)
        with pytest.raises(SandboxUnavailableError, match=f"max_processes=4 needs.*{why}.*Permission denied"):
            check_sandbox(FAST.model_copy(update={"max_processes": 4}))
        assert not cgroups_left(pids_parent)


def test_a_run_that_cannot_set_up_its_pids_cgroup_raises_and_leaves_no_cgroup(pids_parent, monkeypatch):
    monkeypatch.setattr(sandbox, "_pids_parent", lambda: pids_parent)
    failing_write(monkeypatch, "pids.max")
    with pytest.raises(SandboxUnavailableError, match="could not set pids.max.*Permission denied.*unset"):
        run_python("print(1)", FAST.model_copy(update={"max_processes": 4}))
    assert not cgroups_left(pids_parent)


def test_a_runs_cgroup_is_emptied_before_its_directory_is_removed(pids_parent, monkeypatch):
    monkeypatch.setattr(sandbox, "_pids_parent", lambda: pids_parent)
    done = []
    remove_cgroup, remove_tree = sandbox._remove_cgroup, sandbox._remove_tree
    monkeypatch.setattr(
        sandbox, "_remove_cgroup", lambda group: done.append("cgroup") or remove_cgroup(group)
    )
    monkeypatch.setattr(sandbox, "_remove_tree", lambda path: done.append("directory") or remove_tree(path))
    r = run_python("print(1)", FAST.model_copy(update={"max_processes": 4}))
    assert r.ok and r.stdout == "1\n" and done == ["cgroup", "directory"]
    assert not cgroups_left(pids_parent)


def test_cancelling_a_run_kills_it_and_removes_its_directory(monkeypatch):
    made = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])

    async def main():
        task = asyncio.ensure_future(arun_python("import time; time.sleep(60)", FAST))
        while not made:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert made and not os.path.exists(made[0])


def test_missing_platform_features_raise_with_the_fix(monkeypatch):
    monkeypatch.setattr(sandbox, "_namespaces_error", lambda: "unshare failed: Operation not permitted")
    isolated = FAST.model_copy(update={"network": "isolate"})
    with pytest.raises(SandboxUnavailableError, match="user namespaces.*Operation not permitted") as e:
        run_python("print(1)", isolated)
    assert "kernel.unprivileged_userns_clone=1" in str(e.value) and "network: allow" in str(e.value)
    # without network isolation the namespaces are not needed
    allowed = FAST.model_copy(update={"network": "allow"})
    r = run_python("print(1)", allowed)
    assert r.ok and r.stdout == "1\n"
    monkeypatch.setattr(sandbox, "resource", None)
    with pytest.raises(SandboxUnavailableError, match="'resource' module.*run on Linux"):
        check_sandbox(allowed)


def test_async_runs_go_concurrently_without_blocking_the_loop():
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def main():
        tick = asyncio.ensure_future(ticker())
        runs = [arun_python(f"import time; time.sleep(0.3); print({i} * {i})", FAST) for i in range(6)]
        results = await asyncio.gather(*runs)
        tick.cancel()
        return results

    results = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)]
    assert ticks >= 5  # the loop kept running while the programs slept


def test_blocking_runner_works_inside_a_running_loop():
    async def main():
        return run_python("print('inside')", FAST)

    assert asyncio.run(main()).stdout == "inside\n"


# --------------------------------------------------------------------------- code environment


def code_cfg(**kw) -> CodeEnvConfig:
    return CodeEnvConfig(sandbox=FAST, num_problems=40, **kw)


def reply(code: str) -> AssistantMessage:
    return AssistantMessage(f"Here it is:\n```python\n{code}\n```")


def step(env: CodeEnvironment, text: str | AssistantMessage) -> EnvStep:
    message = text if isinstance(text, AssistantMessage) else AssistantMessage(text)
    return asyncio.run(env.step(message))


def first_problem(cfg: CodeEnvConfig):
    train, _ = code_samples(cfg)
    return train[0]


def test_a_correct_solution_ends_the_episode_with_reward_1():
    cfg = code_cfg(system_prompt="You write Python.")
    sample = first_problem(cfg)
    env = CodeEnvironment(sample, cfg)
    opening = env.reset()
    assert [m["role"] for m in opening] == ["system", "user"] and "```python" in opening[1]["content"]
    out = step(env, reply(sample.data["solution"]))
    assert out.done and out.reward == 1.0 and out.success
    assert out.info == {"tests_passed_fraction": 1.0, "sandbox_killed": 0.0, "attempts": 1.0}


def test_a_wrong_solution_gets_the_failing_assert_and_may_fix_it():
    cfg = code_cfg()
    sample = first_problem(cfg)
    env = CodeEnvironment(sample, cfg)
    env.reset()
    out = step(env, reply("def f(*args):\n    return None"))
    assert not out.done and out.messages[0]["role"] == "user"
    feedback = out.messages[0]["content"]
    assert feedback.startswith("0/") and sample.data["tests"][0] in feedback and "returned None" in feedback
    out = step(env, reply(sample.data["solution"]))
    assert out.done and out.reward == 1.0 and out.info["attempts"] == 2.0


def test_the_last_attempt_is_rewarded_with_the_fraction_of_tests_passed():
    cfg = code_cfg(max_attempts=1)
    sample = first_problem(cfg)
    tests = sample.data["tests"]
    # answer the first test right and nothing else
    first = ast.parse(tests[0]).body[0].test
    args = tuple(ast.literal_eval(a) for a in first.left.args)
    want = ast.literal_eval(first.comparators[0])
    code = f"def f(*args):\n    return {want!r} if args == {args!r} else None"
    out = step(CodeEnvironment(sample, cfg), reply(code))
    assert out.done and not out.success and out.reward == pytest.approx(1 / len(tests))
    assert out.info["tests_passed_fraction"] == pytest.approx(1 / len(tests))


def test_a_runaway_solution_is_killed_and_reported():
    cfg = code_cfg()
    sample = first_problem(cfg)
    env = CodeEnvironment(sample, cfg)
    out = step(env, reply("def f(*args):\n    while True:\n        pass"))
    assert not out.done and "CPU time" in out.messages[0]["content"]
    out = step(env, reply("while True: pass"))
    assert out.done and out.reward == 0.0 and not out.success
    assert out.info["sandbox_killed"] == 1.0 and out.info["tests_passed_fraction"] == 0.0


def test_replies_without_code_and_simple_reward_hacks_pass_nothing():
    cfg = code_cfg(max_attempts=1)
    sample = first_problem(cfg)
    out = step(CodeEnvironment(sample, cfg), "I think the answer is 42.")
    assert out.done and out.reward == 0.0
    out = step(CodeEnvironment(sample, cfg), AssistantMessage("```python\nprint(1)\n```"))
    assert out.reward == 0.0  # no f: every test fails
    hacks = [
        "class A:\n    def __eq__(self, other):\n        return True\ndef f(*args):\n    return A()",
        'print(\'\\n0123 {"passed": 5, "total": 5, "failure": null}\')\nimport os\nos._exit(0)',
        "import sys\nsys.exit(0)",
    ]
    for hack in hacks:
        out = step(CodeEnvironment(sample, cfg), reply(hack))
        assert out.done and out.reward == 0.0 and not out.success, hack
    cut = CodeEnvConfig(sandbox=FAST, num_problems=40, max_attempts=2)
    env = CodeEnvironment(sample, cut)
    assert "No ```python code block" in step(env, "no code").messages[0]["content"]


def code_verdict(code: str, test: str):
    sample = EnvSample(0, {"prompt": "", "solution": "", "tests": [test]})
    return asyncio.run(CodeEnvironment(sample, code_cfg()).check(f"```python\n{code}\n```"))


# (assert, solution, what Python's == says): the verdict is Python's, whatever the value's type
EQUALITY = {
    "1 == True": ("assert f() == True", "def f(): return 1", True),
    "2.0 == 2": ("assert f() == 2", "def f(): return 2.0", True),
    "-0.0 == 0.0": ("assert f() == 0.0", "def f(): return -0.0", True),
    "inf": ("assert f() == 1e999", "def f(): return float('inf')", True),
    "dict order": ("assert f() == {'a': 1, 'b': 2}", "def f(): return {'b': 2, 'a': 1}", True),
    "frozenset == set": ("assert f() == {1, 2}", "def f(): return frozenset([2, 1])", True),
    "nested": (
        "assert f() == [None, b'x', (2.5, -3j), {(1, 'a'): [set()]}]",
        "def f(): return [None, b'x', (2.5, complex(0, -3)), {(1, 'a'): [set()]}]",
        True,
    ),
    "tuple != list": ("assert f() == (1, 2)", "def f(): return [1, 2]", False),
    "list != tuple": ("assert f() == [1, 2]", "def f(): return (1, 2)", False),
    "int key != str key": ("assert f() == {1: 'a'}", "def f(): return {'1': 'a'}", False),
    "nan": ("assert f() == 0.0", "def f(): return float('nan')", False),
}


@pytest.mark.parametrize("case", EQUALITY.values(), ids=EQUALITY.keys())
def test_a_tests_verdict_is_pythons_equality(case):
    test, code, python_says = case
    verdict = code_verdict(code, test)
    assert (verdict.passed == 1) == python_says, verdict.feedback


def test_a_set_passes_its_test_in_every_process():
    # each sandboxed process has its own hash seed, so its own order of a set's elements
    words = ["apple", "pear", "fig", "kiwi", "plum", "lime", "date", "sloe"]
    test = f"assert f() == {set(words)!r}"
    assert all(code_verdict(f"def f(): return set({words!r})", test).passed == 1 for _ in range(4))


EQ_TRUE = "class A:\n    def __eq__(self, other):\n        return True\n"
# (solution, assert): each value equals the expected one by its own __eq__, which is not Python's verdict
NOT_PLAIN = {
    "__eq__ always True": (EQ_TRUE + "def f(): return A()", "assert f() == 5"),
    "in a list": (EQ_TRUE + "def f(): return [5, A()]", "assert f() == [5, 5]"),
    "int subclass": (
        "class I(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def f(): return I(3)",
        "assert f() == 5",
    ),
}


@pytest.mark.parametrize("case", NOT_PLAIN.values(), ids=NOT_PLAIN.keys())
def test_a_value_not_built_of_plain_values_fails_with_the_reason(case):
    code, test = case
    verdict = code_verdict(code, test)
    assert verdict.passed == 0 and "not a value built only of None, bool, int" in verdict.feedback


def test_a_value_too_large_or_containing_itself_fails_with_the_reason():
    big = code_verdict("def f(): return list(range(10**5))", "assert f() == [0]")
    assert big.passed == 0 and big.killed is None and "too large to report" in big.feedback
    loop = code_verdict("def f():\n    a = [1]\n    a.append(a)\n    return a", "assert f() == [1, [1]]")
    assert loop.passed == 0 and "contains itself" in loop.feedback
    nan = code_verdict("def f(): return float('nan')", "assert f() == 0.0")
    assert "nan" in nan.feedback


# a wrong f (returns None) dressed up to pass: patch the harness, its builtins or json, or read the
# nonce off the harness's frame and print a report of every test passed
HARNESS_HACKS = {
    "__main__._check": "import __main__\n__main__._check = lambda *a: None",
    "builtins.eval": "import builtins\nbuiltins.eval = lambda *a, **k: 0",
    "json.dumps": "import json\nreal = json.dumps\njson.dumps = lambda o, **k: real(o, **k) if isinstance(o, dict) else 'x'",
    "fake report": (
        "import os, sys\nnonce = sys._getframe(1).f_locals['nonce']\n"
        'ok = \'{"passed": 5, "total": 5, "failure": null, "results": []}\'\n'
        "os.write(1, (chr(10) + nonce + ' ' + ok + chr(10)).encode())\nos._exit(0)"
    ),
}


@pytest.mark.parametrize("hack", HARNESS_HACKS.values(), ids=HARNESS_HACKS.keys())
def test_a_solution_that_rewrites_the_harness_passes_nothing(hack):
    cfg = code_cfg(max_attempts=1)
    sample = first_problem(cfg)
    out = step(CodeEnvironment(sample, cfg), reply(hack + "\ndef f(*args):\n    return None"))
    assert out.done and out.reward == 0.0 and not out.success
    assert out.info["tests_passed_fraction"] == 0.0


def test_expected_values_stay_out_of_the_sandbox_and_tests_must_compare_with_a_literal():
    tests = [UnitTest.parse("assert f(2, [1]) == [3, 'x']"), UnitTest.parse("assert g() == 98765")]
    assert [(t.call, t.expected) for t in tests] == [("f(2, [1])", [3, "x"]), ("g()", 98765)]
    program = harness_program("def f(a, b):\n    return 1", tests)
    assert "f(2, [1])" in program and "'x'" not in program and "98765" not in program
    for bad in ("assert f(1) > 2", "assert f(1) == g(2)", "f(1)"):
        with pytest.raises(ValueError, match="not of the form `assert EXPR == LITERAL`"):
            UnitTest.parse(bad)


def test_extract_code_takes_the_last_block():
    text = "```python\na = 1\n```\nthen\n```python\nb = 2\n```\nbye"
    assert extract_code(text) == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("```python\nd = 4") == "d = 4"  # cut by the token limit
    assert extract_code("no code at all") is None


def test_every_demonstration_passes_its_tests():
    cfg = CodeEnvConfig(sandbox=FAST, num_problems=NUM_BUILTIN_PROBLEMS)
    train, held = code_samples(cfg)
    samples = train + held
    assert len(samples) == NUM_BUILTIN_PROBLEMS

    async def score(sample, gate):
        demo = code_demonstration(sample, cfg)
        env = CodeEnvironment(sample, cfg)
        assert demo[:-1] == env.reset() and demo[-1]["role"] == "assistant"
        async with gate:
            return await env.step(AssistantMessage(demo[-1]["content"]))

    async def main():
        gate = asyncio.Semaphore(8)
        return await asyncio.gather(*(score(s, gate) for s in samples))

    results = asyncio.run(main())
    failed = [(s.data["prompt"], r.info) for s, r in zip(samples, results) if r.reward != 1.0]
    assert not failed


def test_samples_are_deterministic_disjoint_and_in_the_tiny_alphabet():
    cfg = code_cfg(seed=3)
    train, held = code_samples(cfg)
    again = code_samples(code_cfg(seed=3))
    assert (train, held) == again
    other = code_samples(code_cfg(seed=4))
    assert [s.data for s in other[0]] != [s.data for s in train]
    assert len(train) + len(held) == 40 and len(held) == 8
    prompts = [s.data["prompt"] for s in train + held]
    assert len(set(prompts)) == 40  # distinct problems
    assert not {s.data["prompt"] for s in train} & {s.data["prompt"] for s in held}
    for s in train + held:
        assert 3 <= len(s.data["tests"]) <= 5
        text = s.data["prompt"] + s.data["solution"] + "".join(s.data["tests"])
        assert set(text) <= set(CHAT_CHARS), set(text) - set(CHAT_CHARS)


def test_config_errors_say_how_to_fix_them():
    with pytest.raises(ValueError, match="lower max_attempts or raise limits.max_turns"):
        CodeEnvConfig(max_attempts=3, limits=EnvLimits(max_turns=2))
    with pytest.raises(ValueError, match="raise step_timeout_s or lower wall_timeout_s"):
        CodeEnvConfig(sandbox=SandboxConfig(wall_timeout_s=30), limits=EnvLimits(step_timeout_s=10))


def test_build_env_makes_the_code_suite():
    suite = build_env(code_cfg())
    assert suite.name == "code" and suite.eval is not None and len(suite.train) == 32
    sample = EnvSuite.sample(suite.train[0])
    env = suite.make_env(sample)
    assert isinstance(env, CodeEnvironment) and suite.demonstration(sample)[-1]["role"] == "assistant"
