#!/usr/bin/env bash
# The step-time/memory benchmark on CUDA, sized to finish in under 5 minutes on one GPU.
# Prints the tables and writes benchmarks/results/step_time_cuda.{md,json} (and under $OUT when
# set, for the device tool). Usage: bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
"$python" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
timeout 280 "$python" benchmarks/step_time.py --device cuda --repeats 20 --max-chunk 256
if [ -n "${OUT:-}" ]; then cp benchmarks/results/step_time_cuda.* "$OUT"/; fi
