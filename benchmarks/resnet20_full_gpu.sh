#!/usr/bin/env bash
# Issue 23's full-length ResNet20-GN comparison on one GPU, as the device tool runs it: GEP, GP
# and Opacus at their validation winners (tuned on the CPU at 15 epochs, TAN 8) retrained side
# by side at the GEP paper's 200 epochs, epsilon 8, or the longest length that fits MINUTES
# (benchmarks/full_length.py), and tested once on CIFAR-10 batch 5. The data comes from
# ../shared/data, or from a .device-data pack (benchmarks/device_data.py) where that folder is
# not beside the checkout; packages missing there come as wheels in .whl. Results land in $OUT
# (default /tmp/resnet20_full): full_length.jsonl (append to
# benchmarks/results/standard/cifar10.jsonl to tabulate), summary.json and a log per method.
#   bash benchmarks/resnet20_full_gpu.sh [MINUTES] [EPOCHS]   (default 8, 200; with EPOCHS
#   given, the one-epoch timing is skipped and EPOCHS run at once)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
out=${OUT:-/tmp/resnet20_full}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
data=../shared/data
if [ ! -d "$data/cifar10" ] && [ -d .device-data ]; then
  data=/tmp/gep-fed-data
  "$python" benchmarks/device_data.py unpack .device-data "$data"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$python" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
"$python" benchmarks/full_length.py --device cuda --minutes "${1:-8}" --epochs "${2:-200}" \
  ${2:+--no-timing} --threads 4 --out "$out" -- --dataset cifar10 --features raw --grid resnet --epsilon 8 \
  --tan 8 --data-dir "$data"
