"""Run untrusted Python in a subprocess with resource limits and no network.

`arun_python(code, cfg)` (asyncio: many runs at once without blocking the event loop) and
`run_python(code, cfg)` (the same, blocking) write `code` to main.py in a fresh temporary directory
(removed afterwards, however the run ends) and run it as `sys.executable -I -S -u main.py`: no
site-packages, no PYTHON* variables, an environment of only PATH and LANG, stdin closed or given.
The process tree (the launcher is envs/_sandbox_child.py):

    launcher, in new user + network + PID namespaces (network: isolate)
      └─ init of the PID namespace: waits for the program, reports its exit status and CPU time
           └─ the program, with rlimits: CPU seconds, address space, file size, open files, no core

The rlimits are per process: a program that forks gives each child its own CPU seconds and address
space. `max_processes` (opt-in) bounds how many processes and threads it may have at once, through a
cgroup of the pids controller made for the run (the launcher joins it before anything forks; at the
end whatever is left in it is killed and the cgroup removed, then the run's directory); it needs a pids
controller this process may make a cgroup in, set up and move processes into (root, or a delegated
cgroup): `check_sandbox` tries all three once per process and refuses the config where one fails, and
should one fail in a run after all, the run raises `SandboxUnavailableError` (a trajectory does not
fail for it: the training run stops, rollout/trajectory.py).
(RLIMIT_NPROC would not do: it counts all of the user's processes outside a user namespace, and
exempts root.) The launcher and the processes it forks die with their parent (PR_SET_PDEATHSIG), so a
trainer killed without cleaning up (OOM killer, a killed Ray actor) leaves no run behind.

Past `wall_timeout_s`, or once stdout and stderr together pass `max_output_bytes` (read as they come,
the first bytes kept), the launcher's process group is killed; the PID namespace then takes every
process the program started with it, also ones that left the group. `SandboxResult.killed` says why a
run was stopped: our kill ("timeout", "output"), the CPU limit ("cpu": SIGXCPU, or SIGKILL at the hard
limit, told apart from other kills by the CPU time the program used) or memory ("memory": a
MemoryError or ENOMEM in a failed run's stderr; under RLIMIT_AS Python raises instead of dying).

Linux only. Network isolation needs unprivileged user namespaces; `check_sandbox` (called by every
run, a probe cached per process) raises `SandboxUnavailableError` naming what is missing and the fix.
`network: allow` runs without namespaces: the host's network, and a program that calls setsid()
can outlive the run (unless `max_processes` is set: its cgroup is emptied at the end).

Not a security boundary against a determined attacker: the program runs as your user and can read
what you can read and write outside its directory. It bounds resources and cuts the network; run the
trainer in a container for code you must not trust with your files.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from posttrain.config import Config

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

Killed = Literal["cpu", "memory", "output", "timeout"]

_LAUNCHER = Path(__file__).with_name("_sandbox_child.py")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_CHUNK = 1 << 16
_GRACE_S = 2.0  # after a kill, how long the pipes may take to close before we stop reading
_MEMORY = re.compile(r"\bMemoryError\b|Cannot allocate memory")
_NAMESPACE_FIX = (
    "enable them (sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; on Ubuntu "
    "23.10+ also kernel.apparmor_restrict_unprivileged_userns=0; in a container, allow unshare) or set "
    "sandbox.network: allow to run the code with the host's network"
)


class SandboxUnavailableError(RuntimeError):
    """This platform lacks something the sandbox config asks for; the message says what and the fix."""


class SandboxConfig(Config):
    """Limits of one sandboxed run."""

    cpu_time_s: int = Field(
        2, ge=1, description="CPU seconds of each process (RLIMIT_CPU); past them SIGXCPU stops the program"
    )
    memory_mb: int = Field(
        512,
        ge=64,
        description="address space in MiB of each process (RLIMIT_AS, per process: the program's children "
        "get as much each; max_processes bounds their number); allocations past it raise MemoryError",
    )
    max_output_bytes: int = Field(
        65536, ge=1024, description="stdout and stderr kept, together; past it the program is killed"
    )
    wall_timeout_s: float = Field(
        10.0, gt=0, description="wall-clock bound (a sleeping program uses no CPU); past it all is killed"
    )
    max_open_files: int = Field(64, ge=16, description="open file descriptors (RLIMIT_NOFILE)")
    max_file_mb: int = Field(
        16, ge=1, description="size of any file written, MiB (RLIMIT_FSIZE); writes past it fail"
    )
    max_processes: int | None = Field(
        None,
        ge=1,
        description="processes and threads the program and all it starts may have at once (a pids cgroup "
        "per run; needs a cgroup pids controller this process may write to: root, or a delegated cgroup; "
        "refused with the fix where there is none). None: no bound; then, as cpu_time_s and memory_mb "
        "bound each process, N processes may use N x memory_mb",
    )
    network: Literal["isolate", "allow"] = Field(
        "isolate",
        description="isolate: new user + network + PID namespaces (only a down loopback inside; Linux with "
        "unprivileged user namespaces); allow: the host's network and no namespaces",
    )


@dataclass
class SandboxResult:
    """How a run ended. `exit_code` is -N when signal N ended the program (-9 when the sandbox killed
    it); `killed` says why it was stopped (None: it ended by itself); `truncated`: output was cut at
    `max_output_bytes`; `seconds`: wall clock; `cpu_seconds`: the program's CPU time (None if killed
    by the sandbox before it was measured)."""

    stdout: str
    stderr: str
    exit_code: int
    killed: Killed | None
    truncated: bool
    seconds: float
    cpu_seconds: float | None = None

    @property
    def ok(self) -> bool:
        """The program ran to the end and exited 0."""
        return self.exit_code == 0 and self.killed is None


# --------------------------------------------------------------------------- platform


def check_sandbox(cfg: SandboxConfig) -> None:
    """Raise `SandboxUnavailableError` if this platform cannot enforce `cfg` (the first call with
    network isolation runs a probe, cached for the process)."""
    if resource is None:
        raise SandboxUnavailableError(
            f"the sandbox's limits (CPU time, memory, file size, open files) need the POSIX 'resource' "
            f"module, which Python on {sys.platform} lacks; run on Linux (a container or WSL2 will do)"
        )
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailableError(
            f"the sandbox's memory limit (RLIMIT_AS) is enforced only on Linux, not on {sys.platform}; "
            "run on Linux (a container will do)"
        )
    if cfg.max_processes is not None and isinstance(_pids_parent(), str):
        raise SandboxUnavailableError(
            f"sandbox.max_processes={cfg.max_processes} needs a cgroup pids controller to make a cgroup in: "
            f"{_pids_parent()}; run as root, give this process a delegated cgroup (systemd-run --user "
            "--scope -p Delegate=yes ...), or unset sandbox.max_processes"
        )
    if cfg.network == "isolate":
        problem = _namespaces_error()
        if problem is not None:
            raise SandboxUnavailableError(
                f"network isolation needs Linux user namespaces (unshare), which failed here: {problem}; "
                + _NAMESPACE_FIX
            )


@functools.cache
def _namespaces_error() -> str | None:
    """Why new user/network/PID namespaces cannot be made here, or None when they can."""
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", str(_LAUNCHER), "--probe"],
            capture_output=True,
            text=True,
            timeout=30,
            env=_ENV,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"the probe could not run ({e})"
    return None if proc.returncode == 0 else proc.stderr.strip() or f"the probe exited {proc.returncode}"


@functools.cache
def _pids_parent() -> Path | str:
    """The cgroup (of the pids controller, v1 or v2) of this process where a run's own cgroup can be
    made, set up and joined (`_probe_pids`), or why there is none."""
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError as e:
        return f"cannot read /proc ({e})"
    problems = []
    for line in mounts:
        fields, _, fs = line.partition(" - ")
        root, point = fields.split()[3:5]
        kind, _, options = fs.split()[:3]
        if kind == "cgroup" and "pids" in options.split(","):  # v1: the pids hierarchy's own line
            mine = [c.split(":", 2)[2] for c in own if "pids" in c.split(":")[1].split(",")]
        elif kind == "cgroup2":
            mine = [c.split(":", 2)[2] for c in own if c.startswith("0::")]
        else:
            continue
        if mine:
            parent = Path(point, os.path.relpath(mine[0], root))
            problem = _probe_pids(parent)
            if problem is None:
                return parent
            problems.append(problem)
    return "; ".join(problems) or "no cgroup hierarchy with the pids controller holds this process"


def _probe_pids(parent: Path) -> str | None:
    """Do in `parent` what a run does (make a cgroup, write its pids.max, move a process into it; on
    cgroup v2 moving needs write access to the parent's cgroup.procs too), then clean up; None when
    all of it worked, else what failed."""
    try:
        probe = Path(tempfile.mkdtemp(prefix="posttrain-probe-", dir=parent))
    except OSError as e:
        return f"cannot make a cgroup in {parent} ({e})"
    child = None
    try:
        if not (probe / "pids.max").exists():  # v2: only where the parent delegates pids
            return f"{parent} does not delegate the pids controller to its child cgroups"
        try:
            (probe / "pids.max").write_text("64")
        except OSError as e:
            return f"cannot set pids.max of a cgroup in {parent} ({e})"
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", "import sys; sys.stdin.read()"],  # waits for our EOF
            stdin=subprocess.PIPE,
            env=_ENV,
        )
        try:
            (probe / "cgroup.procs").write_text(str(child.pid))
        except OSError as e:
            return f"cannot move a process into a cgroup in {parent} ({e})"
        return None
    except OSError as e:
        return f"cannot start a process to probe the cgroup in {parent} ({e})"
    finally:
        if child is not None:
            child.kill()
            child.wait()
            if child.stdin is not None:
                child.stdin.close()
        _remove_cgroup(probe)


def _pids_cgroup(cfg: SandboxConfig) -> Path | None:
    """A new cgroup allowing the program `max_processes` tasks beside the launcher (and the namespace's
    init), or None when the config sets no bound. `SandboxUnavailableError` (and nothing left behind)
    when it cannot be made or set up."""
    if cfg.max_processes is None:
        return None
    parent = _pids_parent()
    assert isinstance(parent, Path)  # check_sandbox refused the run otherwise
    fix = "; unset sandbox.max_processes or run where this process may manage a pids cgroup"
    try:
        group = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-", dir=parent))
    except OSError as e:
        raise SandboxUnavailableError(
            f"the sandbox could not make a pids cgroup in {parent}: {e}{fix}"
        ) from e
    try:
        (group / "pids.max").write_text(str(cfg.max_processes + (2 if cfg.network == "isolate" else 1)))
    except OSError as e:
        with suppress(OSError):
            group.rmdir()
        raise SandboxUnavailableError(f"the sandbox could not set pids.max of {group}: {e}{fix}") from e
    return group


def _remove_cgroup(group: Path) -> None:
    """Kill what is left in a run's cgroup (processes that left the launcher's group: without
    namespaces nothing else reaches them) and remove it."""
    for _ in range(100):  # the killed take a moment to leave it
        with suppress(OSError):
            pids = (group / "cgroup.procs").read_text().split()
            for pid in pids:
                with suppress(ProcessLookupError, PermissionError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            group.rmdir()
            return
        time.sleep(0.05)
    log.warning("could not remove the sandbox's cgroup %s", group)


# --------------------------------------------------------------------------- running


def run_python(code: str, cfg: SandboxConfig, stdin: str | bytes | None = None) -> SandboxResult:
    """Run `code` in the sandbox and wait for it (see the module docstring). Blocks: from async code,
    await `arun_python` instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(arun_python(code, cfg, stdin))
    with ThreadPoolExecutor(1) as pool:  # a loop runs in this thread: give the run its own
        return pool.submit(lambda: asyncio.run(arun_python(code, cfg, stdin))).result()


async def arun_python(code: str, cfg: SandboxConfig, stdin: str | bytes | None = None) -> SandboxResult:
    """Run `code` in the sandbox (see the module docstring) without blocking the event loop. Raises
    `SandboxUnavailableError` when the platform lacks what `cfg` asks for. Cancelling it kills the run."""
    await asyncio.to_thread(check_sandbox, cfg)
    workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    group = None
    try:
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        group = _pids_cgroup(cfg)
        return await _Run(cfg, workdir, group).run(data)
    finally:
        if group is None:
            _remove_tree(workdir)
        else:  # on a thread (what is left in the cgroup may take a moment to die), which finishes even
            # if this task is cancelled meanwhile: the processes are killed before their directory goes
            await asyncio.shield(asyncio.to_thread(_clean_up, group, workdir))


def _clean_up(group: Path, workdir: str) -> None:
    try:
        _remove_cgroup(group)
    finally:
        _remove_tree(workdir)


def _limits(cfg: SandboxConfig) -> list[tuple[str, int, int]]:
    mib = 1 << 20
    return [
        ("RLIMIT_CPU", cfg.cpu_time_s, cfg.cpu_time_s + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard
        ("RLIMIT_AS", cfg.memory_mb * mib, cfg.memory_mb * mib),
        ("RLIMIT_FSIZE", cfg.max_file_mb * mib, cfg.max_file_mb * mib),
        ("RLIMIT_NOFILE", cfg.max_open_files, cfg.max_open_files),
        ("RLIMIT_CORE", 0, 0),
    ]


class _Run:
    """One run: spawn the launcher, read its output under the cap, enforce the wall clock."""

    def __init__(self, cfg: SandboxConfig, workdir: str, group: Path | None) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.group = group
        self.out, self.err = bytearray(), bytearray()
        self.kept = 0
        self.truncated = False
        self.killed: Killed | None = None
        self.proc: asyncio.subprocess.Process | None = None

    async def run(self, stdin: bytes | None) -> SandboxResult:
        start = time.monotonic()
        status_r, status_w = os.pipe()
        try:
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *self._command(status_w),
                    stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    cwd=self.workdir,
                    env=_ENV,
                    start_new_session=True,  # its own process group, killed as one
                    pass_fds=(status_w,),
                )
            finally:
                os.close(status_w)
            try:
                await self._communicate(stdin)
            finally:
                if self.proc.returncode is None:  # cancelled or failed here: leave nothing running
                    self._kill(None)
                await self.proc.wait()
            status = _read_status(status_r)
        finally:
            os.close(status_r)
        return self._result(status, time.monotonic() - start)

    def _command(self, status_fd: int) -> list[str]:
        spec = {
            "isolate": self.cfg.network == "isolate",
            "parent": os.getpid(),  # the launcher dies with this process (PR_SET_PDEATHSIG)
            "cgroup": None if self.group is None else str(self.group / "cgroup.procs"),  # it joins it first
            "status_fd": status_fd,
            "python": sys.executable,
            "script": "main.py",
            "limits": _limits(self.cfg),
        }
        return [sys.executable, "-I", "-S", str(_LAUNCHER), json.dumps(spec)]

    async def _communicate(self, stdin: bytes | None) -> None:
        assert self.proc is not None and self.proc.stdout is not None and self.proc.stderr is not None
        tasks = [
            asyncio.ensure_future(self._read(self.proc.stdout, self.out)),
            asyncio.ensure_future(self._read(self.proc.stderr, self.err)),
            asyncio.ensure_future(self.proc.wait()),
        ]
        if stdin is not None:
            tasks.append(asyncio.ensure_future(self._feed(self.proc.stdin, stdin)))
        try:
            _, pending = await asyncio.wait(tasks, timeout=self.cfg.wall_timeout_s)
            if pending:
                self._kill("timeout")
                await asyncio.wait(pending, timeout=_GRACE_S)
        finally:
            for task in tasks:
                task.cancel()

    async def _read(self, stream: asyncio.StreamReader, sink: bytearray) -> None:
        while chunk := await stream.read(_CHUNK):
            room = self.cfg.max_output_bytes - self.kept
            sink += chunk[:room]
            self.kept += min(room, len(chunk))
            if len(chunk) > room:
                self.truncated = True
                self._kill("output")
                return

    @staticmethod
    async def _feed(pipe: asyncio.StreamWriter | None, data: bytes) -> None:
        assert pipe is not None
        try:
            pipe.write(data)
            await pipe.drain()
            pipe.close()
        except (BrokenPipeError, ConnectionResetError):  # the program exited without reading it all
            pass

    def _kill(self, reason: Killed | None) -> None:
        assert self.proc is not None
        if self.killed is None:
            self.killed = reason
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _result(self, status: str, seconds: float) -> SandboxResult:
        assert self.proc is not None and self.proc.returncode is not None
        stderr = self.err.decode("utf-8", errors="replace")
        if status.startswith("error "):
            raise SandboxUnavailableError(
                f"the sandbox could not isolate the program: {status[6:].strip()}; " + _NAMESPACE_FIX
            )
        if status.startswith("limit "):
            raise SandboxUnavailableError(
                f"the sandbox could not bound the program's processes: {status[6:].strip()}; unset "
                "sandbox.max_processes or run where this process may manage a pids cgroup"
            )
        exit_code, cpu = self.proc.returncode, None
        if status.startswith("exit "):
            _, code, cpu_s = status.split()
            exit_code, cpu = int(code), float(cpu_s)
        elif self.killed is not None:
            exit_code = -signal.SIGKILL
        return SandboxResult(
            stdout=self.out.decode("utf-8", errors="replace"),
            stderr=stderr,
            exit_code=exit_code,
            killed=self.killed or _why_it_died(exit_code, cpu, stderr, self.cfg),
            truncated=self.truncated,
            seconds=seconds,
            cpu_seconds=cpu,
        )


def _why_it_died(exit_code: int, cpu: float | None, stderr: str, cfg: SandboxConfig) -> Killed | None:
    """Which limit ended a run we did not kill: the CPU limit (SIGXCPU, or SIGKILL at the hard limit)
    or memory (MemoryError / ENOMEM in a failed run's stderr); None when neither shows."""
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and (cpu or 0) >= cfg.cpu_time_s):
        return "cpu"
    if exit_code != 0 and _MEMORY.search(stderr):
        return "memory"
    return None


def _read_status(fd: int) -> str:
    """The launcher's status line, or "" when it wrote none (killed first)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 4096).decode()
    except BlockingIOError:
        return ""


def _remove_tree(path: str) -> None:
    """Remove the run's directory, also parts the program made unreadable (chmod 000)."""
    with suppress(OSError):
        os.chmod(path, 0o700)
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            p = os.path.join(root, d)
            if not os.path.islink(p):  # never chmod through a link the program planted
                with suppress(OSError):
                    os.chmod(p, 0o700)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        log.warning("could not remove the sandbox directory %s", path)
