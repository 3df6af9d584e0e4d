#!/usr/bin/env bash
# One-time, idempotent set-up: installs torch (the CPU wheel, only if no torch >= 2.6 is present), then
# posttrain with its test/benchmark extras. Run again with nothing changed, it checks and returns in about
# a second: build/setup.stamp records what was installed (the interpreter, pyproject.toml's hash, torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_CPU="torch==2.13.0+cpu"
# PyTorch's CPU wheels are not on PyPI (a bare `torch` there pulls several GB of CUDA packages): this
# index has them for any Linux box; pip's configured indexes still come first where they have the wheel.
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

torch_ok() {
  $PY - <<'PYEOF' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 6) else 1)
PYEOF
}

stamp_of() {
  $PY - <<'PYEOF'
import hashlib, sys, torch
print(sys.executable, torch.__version__, hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())
PYEOF
}

if ! torch_ok; then
  echo "[setup] no torch >= 2.6 found: installing the CPU wheel $TORCH_CPU (from $TORCH_CPU_INDEX)"
  $PY -m pip install -q "$TORCH_CPU" --extra-index-url "$TORCH_CPU_INDEX"
fi
STAMP=build/setup.stamp
ours() {  # posttrain imports from this checkout
  $PY -c "import pathlib, sys, posttrain
sys.exit(not pathlib.Path(posttrain.__file__).resolve().is_relative_to(pathlib.Path('src').resolve()))" 2>/dev/null
}
if [[ -f $STAMP && "$(cat $STAMP)" == "$(stamp_of)" ]] && ours; then
  echo "[setup] up to date ($STAMP): nothing to install"
  exit 0
fi
$PY -m pip install -q -e ".[ray,math,plot,dev]"
mkdir -p build
stamp_of >"$STAMP"
echo "[setup] done: $($PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
