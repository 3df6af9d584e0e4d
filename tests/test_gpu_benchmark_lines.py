"""benchmarks/gpu.py's RESULT lines for the engine's GPU options: a speedup of one option is reported
only from two runs that differ in that option alone, after any fallback a failing configuration took
(a run without graphs against graphs of the compiled step is not the compile's speedup)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from gpu import full_cfg, result_lines  # noqa: E402


def run(seconds: float, **cfg) -> dict:
    return {"engine_cfg": full_cfg(cfg), "engine_s": seconds, "speedup": 2.0, "engine_bw_frac": 0.1}


def names(lines: list[str]) -> dict[str, float]:
    return {line.split()[1]: float(line.split()[2]) for line in lines}


def test_each_speedup_compares_runs_that_differ_in_its_option_alone():
    g = {
        "greedy_no_graphs": run(8.0),
        "greedy_graphs": run(4.0, cuda_graphs=True),
        "greedy_compiled": run(2.0, cuda_graphs=True, compile_decode=True),
        "sampling": run(1.0, cuda_graphs=True, compile_decode=True, overlap_decode=True),
        "greedy": run(1.6, cuda_graphs=True, compile_decode=True, overlap_decode=True),
    }
    got = names(result_lines({"size": "s", "generate": g}))
    assert got["gpu_cuda_graphs_speedup_s"] == 2.0
    assert got["gpu_compile_decode_speedup_s"] == 2.0
    assert got["gpu_overlap_decode_speedup_s"] == 1.25
    # the eager-graph run fell back to no graphs: no graphs or compile speedup from it
    g["greedy_graphs"] = run(8.0)
    got = names(result_lines({"size": "s", "generate": g}))
    assert "gpu_cuda_graphs_speedup_s" not in got and "gpu_compile_decode_speedup_s" not in got
    # compile failed in the fastest run only: overlap is not measured against the compiled run
    g["greedy_graphs"] = run(4.0, cuda_graphs=True)
    g["greedy"] = run(3.2, cuda_graphs=True, overlap_decode=True)
    got = names(result_lines({"size": "s", "generate": g}))
    assert got["gpu_overlap_decode_speedup_s"] == 1.25  # against graphs of the eager step
    assert got["gpu_compile_decode_speedup_s"] == 2.0
