#!/usr/bin/env bash
# The GPU check as one command on the lent machine (README "GPU acceptance"): install the carried wheels
# (bench/gpu_wheels.sh made them here), then `gpu_acceptance.py --quick`; its table and JSON land in $OUT.
#   device run: carry [".whl"], command "bash bench/gpu_quick.sh", timeout_s 600
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/sdflow-quick}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi | tee "$out/nvidia-smi.txt"
df -h /tmp | tail -1
python3 bench/gpu_acceptance.py --quick --budget-s "${SDFLOW_QUICK_BUDGET_S:-500}" --work-dir /tmp/sdflow-quick-work \
  --json "$out/quick.json" 2>&1 | tee "$out/quick.log"
exit "${PIPESTATUS[0]}"
