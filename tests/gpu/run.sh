#!/usr/bin/env bash
# The GPU-only checks, as one script for a CUDA machine (see docs/gpu.md). Writes results under
# $OUT (default /tmp/gpu_out): pytest log and junit XML. Wheels of small packages that the
# machine lacks (flash-linear-attention, kvikio) may be put in shared/wheels/.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
if compgen -G "shared/wheels/*.whl" > /dev/null; then
  pip install --no-deps --no-index shared/wheels/*.whl > "$OUT/pip.log" 2>&1 || true
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" || true
python -m pytest -q -m gpu tests/gpu -p no:cacheprovider --junitxml "$OUT/junit.xml" \
  2>&1 | tee "$OUT/pytest.log"
python tests/gpu/premise.py 2>&1 | tee "$OUT/premise.log"
