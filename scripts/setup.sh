#!/usr/bin/env bash
# One-time, idempotent set-up: installs torch (CPU wheel only if no torch >= 2.6 is present), then posttrain
# with its test/benchmark extras. Safe to run again; it does nothing that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY - <<'PYEOF' 2>/dev/null
import torch, sys
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 6) else 1)
PYEOF
then
  echo "[setup] no torch >= 2.6 found: installing the CPU wheel torch==2.13.0"
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e ".[ray,math,plot,dev]"
echo "[setup] done: $($PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
