#!/usr/bin/env bash
# The GPU checks, as one command on a machine with one CUDA GPU (the device tool's machines: torch and
# transformers preinstalled, no network; the missing wheels travel in .whl/, see
# /work/.library/device/README.md). Logs go to $OUT (default /tmp/gpu_check):
#   env.txt        GPU, driver, versions
#   gpu_tier.log   pytest -m gpu (the tier that needs CUDA), alone on the card: its tests read device memory
#   suite.log/xml  every test that is neither slow nor distributed, with the workers on the GPU (pytest-xdist)
#   demo.log       `posttrain demo` on the GPU, run beside the suite
#   gpu_bench.log  benchmarks/gpu.py, alone on the card (timings)
#   profile.log    benchmarks/decode_profile.py: one decode step split into graph, head, sampler, host
# Each phase has its own time limit so a hang in one still leaves the others' logs; a limit of 0 skips
# the phase (TIER_S, SUITE_S, BENCH_S, PROFILE_S; DEMO_S=0 runs the suite without the demo). The profile
# is off unless PROFILE_S is set: the other defaults already fill one 10-minute device call.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
WHEELS=${WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    cat "$OUT/install.log"
    exit 1
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, tensordict, peft, pydantic; print('torch', torch.__version__, '| transformers', transformers.__version__, '| tensordict', tensordict.__version__, '| peft', peft.__version__, '| pydantic', pydantic.__version__, '|', torch.cuda.get_device_name())"
    nproc
} 2>&1 | tee "$OUT/env.txt"

phase() { echo "=== $1 ($(date +%T))"; }

if [ "${TIER_S:-150}" != 0 ]; then
    phase "gpu tier"
    timeout "${TIER_S:-150}" python3 -m pytest -m gpu -rs -p no:cacheprovider --timeout 120 -o addopts="" -q \
        >"$OUT/gpu_tier.log" 2>&1
    echo "rc $?"
    tail -n 12 "$OUT/gpu_tier.log"
fi

if [ "${SUITE_S:-220}" != 0 ]; then
    phase "suite on the GPU + demo"
    if [ "${DEMO_S:-200}" != 0 ]; then
        (timeout "${DEMO_S:-200}" posttrain demo >"$OUT/demo.log" 2>&1; echo "demo rc $?" >>"$OUT/demo.log") &
    fi
    # SUITE_TESTS: node ids to run instead (e.g. the ones that failed last time)
    select=(-m "not slow and not distributed and not gpu")
    [ -n "${SUITE_TESTS:-}" ] && read -r -a select <<<"$SUITE_TESTS"
    timeout "${SUITE_S:-220}" python3 -m pytest "${select[@]}" -n "${WORKERS:-8}" \
        -p no:cacheprovider --timeout 150 -o addopts="" -q -rf --junitxml="$OUT/suite.xml" >"$OUT/suite.log" 2>&1
    echo "rc $?"
    tail -n 40 "$OUT/suite.log" | grep -E "FAILED|ERROR|passed|failed" | tail -n 30
    wait
    [ -f "$OUT/demo.log" ] && tail -n 6 "$OUT/demo.log"
fi

if [ "${BENCH_S:-240}" != 0 ]; then
    phase "benchmarks/gpu.py"
    timeout "${BENCH_S:-240}" python3 benchmarks/gpu.py --out "$OUT" ${BENCH_ARGS:-} >"$OUT/gpu_bench.log" 2>&1
    echo "rc $?"
    tail -n 25 "$OUT/gpu_bench.log"
fi
if [ "${PROFILE_S:-0}" != 0 ]; then
    phase "benchmarks/decode_profile.py"
    timeout "${PROFILE_S:-0}" python3 benchmarks/decode_profile.py ${PROFILE_ARGS:-} >"$OUT/profile.log" 2>&1
    echo "rc $?"
    grep -E "step|Error" "$OUT/profile.log" | tail -n 8
fi
phase "done"
