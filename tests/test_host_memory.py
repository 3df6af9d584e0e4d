"""Freed host memory stays in the process (posttrain/host_memory.py): each mode in a fresh process, since
the allocator's settings are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from posttrain import host_memory

glibc = pytest.mark.skipif(host_memory._glibc_mallopt() is None, reason="glibc's mallopt only")

# allocate and free a 64 MiB tensor (written to, so every page is touched) 10 times after two warm-ups;
# report the minor page faults of those 10 rounds and the mode in force
CHILD = """
import json, resource, sys
import torch
from posttrain.host_memory import keep_freed_memory
mode = keep_freed_memory()
for _ in range(2):  # the heap may grow once more while the second intra-op thread starts
    torch.ones(16 << 20).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(16 << 20).sum()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"mode": mode, "faults": faults}))
"""


def run_child(mode: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != host_memory.ENV}
    if mode is not None:
        env[host_memory.ENV] = mode
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_keep_reuses_freed_memory_and_release_faults_it_back_in():
    kept = run_child(None)  # keep is the default
    released = run_child("release")
    assert kept["mode"] == "keep" and released["mode"] == "release"
    # 64 MiB is 16384 pages of 4 KiB (32 huge pages where the kernel backs malloc's mmap with them):
    # given back on each free, every round faults them in again; kept, the rounds reuse them (at most
    # one more growth of the heap, as in a warm-up)
    assert released["faults"] >= 10 * 32, released
    assert kept["faults"] <= 16384 and 5 * kept["faults"] < released["faults"], (kept, released)


def test_a_bad_mode_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "always")
    with pytest.raises(ValueError, match=r"POSTTRAIN_HOST_MALLOC='always'.*'keep'.*'release'"):
        host_memory.requested_mode()
    monkeypatch.setenv(host_memory.ENV, " Release ")
    assert host_memory.requested_mode() == "release"
    monkeypatch.delenv(host_memory.ENV)
    assert host_memory.requested_mode() == "keep"


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setattr(host_memory, "_glibc_mallopt", lambda: None)
    assert host_memory.keep_freed_memory() is None
    assert host_memory._applied is None


# a fresh process builds one CPU object of posttrain's and reports the mode before and after
WIRING = """
import json, sys
sys.path.insert(0, {tests!r})
from posttrain import host_memory
before = host_memory._applied
if sys.argv[1] == "engine":
    from posttrain.generation.engine import GenerationEngine
    from posttrain.models.hf import build_tiny_model
    GenerationEngine(build_tiny_model(32))
else:
    from helpers import policy_cfg
    from posttrain.policy.policy import Policy
    Policy(policy_cfg())
print(json.dumps({{"before": before, "after": host_memory._applied}}))
"""


@glibc
@pytest.mark.parametrize("what", ["engine", "policy"])
@pytest.mark.parametrize("mode", [None, "release"])
def test_cpu_engines_and_policy_workers_apply_the_setting(what, mode):
    env = {k: v for k, v in os.environ.items() if k != host_memory.ENV}
    if mode is not None:
        env[host_memory.ENV] = mode
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU objects on every machine (on a GPU the policy trains there)
    code = WIRING.format(tests=os.path.dirname(__file__))
    out = subprocess.run(
        [sys.executable, "-c", code, what], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"before": None, "after": mode or "keep"}
