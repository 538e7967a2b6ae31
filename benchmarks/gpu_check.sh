#!/usr/bin/env bash
# The GPU checks, sized to finish in under 8 minutes on one GPU: the step-time/memory benchmark
# on CUDA (writes benchmarks/results/step_time_cuda.{md,json}), then a short federated CIFAR-10
# ResNet20-GN run (3 sites, client mode, 2 rounds) on CUDA. Copies the results under $OUT when
# set (for the device tool). Usage: bash benchmarks/gpu_check.sh [DATA_DIR] (default ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
data_dir=${1:-../shared/data}
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
"$python" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
timeout 280 "$python" benchmarks/step_time.py --device cuda --repeats 20 --max-chunk 256
run_dir=$(mktemp -d)
timeout 180 "$python" -m gep_fed.cli.main simulate --task cifar10 --model resnet20 \
    --data-dir "$data_dir" --num-sites 3 --mode client --rounds 2 --device cuda \
    --run-dir "$run_dir" | tee "$run_dir/summary.txt"
if [ -n "${OUT:-}" ]; then
    cp benchmarks/results/step_time_cuda.* "$run_dir/summary.txt" "$OUT"/
fi
