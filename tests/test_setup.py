"""scripts/setup.sh, run against a stand-in interpreter (no real install): the CPU torch wheel from
PyTorch's CPU index only when no torch >= 2.6 is there, an existing torch kept, and nothing
installed again once build/setup.stamp says it is all there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import posttrain

REPO = Path(__file__).resolve().parents[1]
SRC = Path(posttrain.__file__).resolve().parents[1]

# The stand-in: `-m pip ...` is logged (and "installs" torch 2.13.0 by writing the fake module); anything
# else runs the real interpreter with the fake torch (if any) first on the path.
STUB = """#!/usr/bin/env bash
if [[ "$1" == "-m" && "$2" == "pip" ]]; then
  echo "pip ${{*:3}}" >> {log}
  if [[ " $* " == *" torch=="* ]]; then
    echo '__version__ = "2.13.0+cpu"' > {fake}/torch/__init__.py
  fi
  exit 0
fi
PYTHONPATH={fake}:{src} exec {python} "$@"
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of what setup.sh reads (scripts/, pyproject.toml, src/ as a link to this package)."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "src").symlink_to(SRC)
    return root


def stub_python(tmp_path: Path, torch_version: str | None) -> tuple[Path, Path]:
    fake, log = tmp_path / "fake", tmp_path / "pip.log"
    (fake / "torch").mkdir(parents=True)  # shadows the real torch
    body = f"__version__ = {torch_version!r}" if torch_version else "raise ImportError('no torch here')"
    (fake / "torch" / "__init__.py").write_text(body + "\n")
    stub = tmp_path / "python"
    stub.write_text(STUB.format(log=log, fake=fake, src=SRC, python=sys.executable))
    stub.chmod(0o755)
    return stub, log


def setup(checkout: Path, stub: Path) -> str:
    env = os.environ | {"PYTHON": str(stub)}
    done = subprocess.run(
        ["bash", str(checkout / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def pip_calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_without_torch_it_installs_the_cpu_wheel_from_the_cpu_index_then_does_nothing(tmp_path, checkout):
    stub, log = stub_python(tmp_path, torch_version=None)
    out = setup(checkout, stub)
    calls = pip_calls(log)
    assert calls[0] == (
        "pip install -q torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu"
    )
    assert calls[1] == "pip install -q -e .[ray,math,plot,dev]" and len(calls) == 2
    assert "installing the CPU wheel" in out
    assert (checkout / "build" / "setup.stamp").read_text().split()[1] == "2.13.0+cpu"

    out = setup(checkout, stub)  # nothing changed: no pip at all
    assert pip_calls(log) == calls and "up to date" in out

    with open(checkout / "pyproject.toml", "a") as f:  # a changed dependency list: install again
        f.write("\n# changed\n")
    setup(checkout, stub)
    assert pip_calls(log)[2:] == ["pip install -q -e .[ray,math,plot,dev]"]


@pytest.mark.parametrize(
    "version, installs_torch", [("2.6.0", False), ("2.11.0+cu128", False), ("2.5.1", True)]
)
def test_a_torch_from_2_6_on_is_kept(tmp_path, checkout, version, installs_torch):
    stub, log = stub_python(tmp_path, torch_version=version)
    setup(checkout, stub)
    assert any(" torch==" in c for c in pip_calls(log)) == installs_torch
