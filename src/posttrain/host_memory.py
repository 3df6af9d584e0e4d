"""How the process's C allocator treats freed host memory, for processes that compute on the CPU.

glibc's malloc serves every request above a threshold (128 KiB, raised on the fly up to 32 MiB) with
its own `mmap` and gives it back with `munmap` on free, and trims the heap's free top back to the
kernel. A CPU train step or decode step allocates and frees the same large tensors (logits, the
activations and their gradients, the attention scores) every micro-batch or token, so each of them
comes back from the kernel as fresh pages: a page fault per 4 KiB and the kernel zeroing every page.
On a 2-core VM that was a third of a 20M-parameter `Policy.train` step (5.4M page faults, 9 s of
system time in 8 steps) and made decode at batch 128 swing between 1.8 and 2.5 s per call
(benchmarks/RESULTS.md, "Freed host memory").

`keep_freed_memory()` turns both off (`mallopt(M_MMAP_MAX, 0)`, `mallopt(M_TRIM_THRESHOLD, 2 GiB)`):
freed blocks stay in the process and the next allocation of that size reuses them, as the jemalloc
or tcmalloc that Intel's and vLLM's CPU guides preload (`dirty_decay_ms:-1`) would. The cost is that
the process keeps its peak heap (about +25% resident memory on that step) instead of handing it back
between steps. `PolicyWorker` and `GenerationEngine` call it when they compute on the CPU; the
environment variable `POSTTRAIN_HOST_MALLOC=release` keeps the C library's defaults instead (e.g.
when several processes share a machine's memory and each must hand back what it frees). Other C
libraries (macOS, musl) are left as they are.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

from posttrain.logging import get_logger

log = get_logger(__name__)

ENV = "POSTTRAIN_HOST_MALLOC"
MODES = ("keep", "release")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: free heap top above 2 GiB still goes back

_applied: str | None = None  # the mode this process runs with, once set


def requested_mode() -> str:
    """The mode `POSTTRAIN_HOST_MALLOC` asks for (default keep); a clear error for any other value."""
    mode = os.environ.get(ENV, "keep").strip().lower() or "keep"
    if mode not in MODES:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r} is not a host-memory mode: set it to 'keep' (freed memory stays "
            "in the process for reuse, the default) or 'release' (the C library's own policy)"
        )
    return mode


@functools.cache
def _glibc_mallopt():
    """glibc's `mallopt`, or None on another C library (looked up once: `libc_ver` reads the
    interpreter's binary)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_freed_memory() -> str | None:
    """Apply the requested mode to this process once (see the module docstring); returns the mode in
    force, or None where the C library is not glibc. Idempotent: later calls change nothing."""
    global _applied
    if _applied is not None:
        return _applied
    mode = requested_mode()
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return None
    if mode == "keep":
        if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
            log.warning("mallopt refused the host-memory settings; freed memory goes back to the kernel")
            mode = "release"
    _applied = mode
    return mode
