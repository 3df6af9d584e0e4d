"""The sandbox's launcher: run by envs/sandbox.py as `python -I -S _sandbox_child.py SPEC`, never imported.

Standard library only (it runs without site-packages). First it asks the kernel to SIGKILL it when
its parent dies (prctl PR_SET_PDEATHSIG; "parent" is the thread that spawned it, the run's event loop,
alive until the run ends), and exits at once if that parent is already gone: a run must not outlive a
trainer killed without the chance to clean up (the OOM killer, a killed Ray actor), since the wall
timeout is the trainer's to enforce. With `isolate`, it moves itself into new user, network and PID
namespaces (unshare), maps its own uid/gid, and forks the PID namespace's init (killed with the
launcher the same way; its death takes every process in the namespace), which forks the program;
without, it forks the program directly (killed with the launcher too; what the program forks is not).
The program's process sets its resource limits and no-new-privileges, closes the status pipe and execs
the interpreter on the script. The process that waited for it writes one line to the status pipe:
`exit CODE CPU_SECONDS` (CODE is -N for signal N), or `error MESSAGE` when the namespaces could not be
made.

`--probe` only tries the namespaces (exit 0, or the reason on stderr and exit 1).
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def isolate(libc):
    """New user + network + PID namespaces for this process's children, with our uid/gid mapped."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUSER|CLONE_NEWNET|CLONE_NEWPID) failed: {os.strerror(err)}")
    try:
        _write("/proc/self/setgroups", "deny")
    except FileNotFoundError:  # kernels before 3.19 have no setgroups file
        pass
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def die_with_parent(libc, parent_gone):
    """SIGKILL this process when its parent dies; exit now if it already has (`parent_gone()`: it died
    before the request was in place)."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_gone():
        os._exit(1)


def closed(fd):
    """Whether every write end of pipe `fd` is closed (its holder exited)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1) == b""
    except BlockingIOError:
        return False


def set_limits(limits):
    """setrlimit for each [name, soft, hard], never above the hard limit we were given."""
    for name, soft, hard in limits:
        which = getattr(resource, name)
        current_hard = resource.getrlimit(which)[1]
        if current_hard != resource.RLIM_INFINITY:
            hard = min(hard, current_hard)
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))


def run_program(spec, libc):
    """Fork the program, wait for it, report its exit status and CPU time on the status pipe."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(spec["status_fd"])
            die_with_parent(libc, lambda: os.getppid() != parent)  # without namespaces, nothing else would
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            set_limits(spec["limits"])
            python = spec["python"]
            os.execv(python, [python, "-I", "-S", "-u", spec["script"]])
        except BaseException as e:  # noqa: BLE001 - reported on the program's stderr
            os.write(2, f"sandbox: cannot start the program: {e}\n".encode())
        os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os.write(spec["status_fd"], f"exit {code} {usage.ru_utime + usage.ru_stime:.3f}\n".encode())


def main():
    libc = _libc()
    if sys.argv[1] == "--probe":
        try:
            isolate(libc)
        except OSError as e:
            sys.stderr.write(f"{e.strerror or e}\n")
            os._exit(1)
        os._exit(0)
    spec = json.loads(sys.argv[1])
    die_with_parent(libc, lambda: os.getppid() != spec["parent"])
    if spec["cgroup"]:  # the run's pids cgroup: everything forked from here on counts against it
        try:
            _write(spec["cgroup"], str(os.getpid()))
        except OSError as e:
            os.write(spec["status_fd"], f"limit cannot join {spec['cgroup']}: {e}\n".encode())
            os._exit(1)
    if not spec["isolate"]:
        run_program(spec, libc)
        os._exit(0)
    try:
        isolate(libc)
    except OSError as e:
        os.write(spec["status_fd"], f"error {e.strerror or e}\n".encode())
        os._exit(1)
    alive_r, alive_w = os.pipe()  # the write end stays open here until the launcher exits
    pid = os.fork()
    if pid == 0:  # pid 1 of the new PID namespace: when it exits, the kernel kills all left inside
        try:
            os.close(alive_w)
            die_with_parent(libc, lambda: closed(alive_r))  # (its getppid() is 0: the parent is outside)
            os.close(alive_r)
            run_program(spec, libc)
        finally:
            os._exit(0)
    os.close(alive_r)
    os.waitpid(pid, 0)
    os._exit(0)


if __name__ == "__main__":
    main()
