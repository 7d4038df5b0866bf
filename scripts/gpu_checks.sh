#!/bin/bash
# Every GPU check of the repository, in one go, for a machine with a CUDA GPU (a few minutes on one H200):
#   1. the tests marked gpu (offload to pinned host memory, a tiny roundpipe plan);
#   2. scripts/gpu_check.py (`make gpu-check`): the simulator against measured single-GPU plans;
#   3. scripts/roundpipe_gpu_check.py: roundpipe plans through the roundpipe library;
#   4. scripts/titan_gpu_check.py: one plan (Llama-3-8B shapes, 4 layers) with autotune's runner and with
#      torchtitan's own model and FSDP2, tokens/s and peak memory side by side (torchtitan 0.3 and what it
#      imports from .engines/site, `make engines`, or from the wheels in .whl/).
# Each step has its own time limit (T1, T2, T3, T4 seconds) and writes its log under $OUT (default
# /tmp/gpu-checks). PY is the Python that has torch with CUDA (default python3). Wheels in .whl/ (for a
# machine without a package index: roundpipe, beartype) are installed to /tmp/site first when present.
#
#   OUT=/tmp/gpu-checks bash scripts/gpu_checks.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
    date
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c "import torch; print('torch', torch.__version__)"
    $PY -c "import roundpipe; print('roundpipe', roundpipe.__file__)"
    $PY -c "import torchtitan; print('torchtitan', torchtitan.__file__)"
} 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
timeout "${T1:-150}" $PY -m pytest -m gpu -p no:cacheprovider --timeout 140 \
    tests/integration/runner/test_runner_zero.py tests/unit/runner/test_roundpipe_runner.py \
    tests/integration/runner/test_fidelity_modes_run.py \
    --deselect tests/integration/runner/test_fidelity_modes_run.py::test_gpu_check_on_cuda 2>&1 | tee "$OUT/pytest_gpu.txt"
echo "pytest: $(($(date +%s) - t0)) s" | tee -a "$OUT/pytest_gpu.txt"
t0=$(date +%s)
timeout "${T2:-240}" $PY scripts/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.txt"
echo "gpu_check: $(($(date +%s) - t0)) s" | tee -a "$OUT/gpu_check.txt"
t0=$(date +%s)
timeout "${T3:-200}" $PY scripts/roundpipe_gpu_check.py --out "$OUT/roundpipe" 2>&1 | tee "$OUT/roundpipe_gpu_check.txt"
echo "roundpipe_gpu_check: $(($(date +%s) - t0)) s" | tee -a "$OUT/roundpipe_gpu_check.txt"
t0=$(date +%s)
timeout "${T4:-300}" $PY scripts/titan_gpu_check.py --out "$OUT/titan_gpu_check.json" 2>&1 | tee "$OUT/titan_gpu_check.txt"
echo "titan_gpu_check: $(($(date +%s) - t0)) s" | tee -a "$OUT/titan_gpu_check.txt"
