"""benchmarks/repeat.py: each RESULT of a benchmark run several times, with min / median / max, and
the median in the protocol's RESULT format; a failing run or inconsistent results end it non-zero."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from repeat import RepeatError, collect, parse_results, report  # noqa: E402

HANG_GUARD_S = 60

# a stand-in benchmark: run k (counted in a file) prints speed 10+k*k and a fixed memory ratio,
# and exits with FAIL_AT's code at that run
FAKE = """
import os, sys
from pathlib import Path
counter = Path(sys.argv[1])
k = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(k + 1))
print("some chatter", k)
if os.environ.get("FAIL_AT") == str(k):
    print("boom at run", k)
    sys.exit(3)
print(f"RESULT speed {10 + k * k} target >=12")
print("RESULT mem_ratio 0.5 target <=1")
"""


def _repeat(tmp_path: Path, runs: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    fake = tmp_path / "fake_bench.py"
    fake.write_text(FAKE)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "repeat.py"), "--runs", str(runs), "--keep"]
    cmd += [str(tmp_path / "logs"), "--", sys.executable, str(fake), str(tmp_path / "counter")]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, env={"PATH": "/usr/bin", **(env or {})}
    )


def test_repeat_reports_the_band_and_the_median_as_the_result(tmp_path):
    proc = _repeat(tmp_path, 5)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    # speeds 10, 11, 14, 19, 26: median 14
    assert "speed: min 10  median 14  max 26  over 5 runs (10 11 14 19 26)" in lines
    assert lines[-2:] == ["RESULT speed 14 target >=12", "RESULT mem_ratio 0.5 target <=1"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [f"run{k}.txt" for k in range(5)]
    assert "some chatter 3" in (tmp_path / "logs" / "run3.txt").read_text()


def test_a_failing_run_ends_the_repeat_with_its_code_and_output(tmp_path):
    proc = _repeat(tmp_path, 5, {"FAIL_AT": "2"})
    assert proc.returncode != 0
    assert "run 2" in proc.stderr and "exited with code 3" in proc.stderr and "boom at run 2" in proc.stderr
    assert (tmp_path / "counter").read_text() == "3"  # nothing ran after the failure
    assert "run 1: speed 11" in proc.stdout and "RESULT" not in proc.stdout  # no summary of a failed repeat


def test_parse_and_collect_reject_what_cannot_be_compared():
    assert parse_results("x\nRESULT a 1.5 target >=1\nRESULT b nan target <=2\n")["a"] == (1.5, ">=1")
    with pytest.raises(RepeatError, match="printed twice"):
        parse_results("RESULT a 1 target >=1\nRESULT a 2 target >=1")
    with pytest.raises(RepeatError, match="no RESULT line"):
        collect([{}])
    with pytest.raises(RepeatError, match="run 1 reported"):
        collect([{"a": (1.0, ">=1")}, {"b": (1.0, ">=1")}])
    with pytest.raises(RepeatError, match="target"):
        collect([{"a": (1.0, ">=1")}, {"a": (1.0, ">=2")}])
    values = collect([{"a": (3.0, ">=1")}, {"a": (1.0, ">=1")}, {"a": (2.0, ">=1")}])
    assert report(values) == ["a: min 1  median 2  max 3  over 3 runs (3 1 2)", "RESULT a 2 target >=1"]
