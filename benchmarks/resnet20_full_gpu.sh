#!/usr/bin/env bash
# Issue 23's full-length ResNet20-GN comparison on one GPU, as the device tool runs it: GEP, GP
# and Opacus at their validation winners (tuned on the CPU at 15 epochs, TAN 8) retrained side
# by side at the GEP paper's 200 epochs, epsilon 8, or the longest length that fits MINUTES
# (benchmarks/full_length.py), and tested once on CIFAR-10 batch 5. The data comes from
# ../shared/data, or from a .device-data pack (benchmarks/device_data.py) where that folder is
# not beside the checkout; packages missing there come as wheels in .whl. Results land in $OUT
# (default /tmp/resnet20_full): full_length.jsonl (append to
# benchmarks/results/standard/cifar10.jsonl to tabulate), summary.json and a log per method.
#   bash benchmarks/resnet20_full_gpu.sh [MINUTES] [EPOCHS...]
# MINUTES defaults to 8. Without EPOCHS, a two-epoch timing chooses the length (up to 200);
# with EPOCHS, each length runs at once, all lengths side by side, each in $OUT/e<EPOCHS>.
# From the environment: METHODS (default "gep gp opacus"), EPSILON (default 8; the grid tuned
# at that epsilon), SEED (default 0; another retrains the seed-0 winners at that seed), and
# LEVERS (e.g. "warm": each method's validation winner among its grid plus those levers; a
# method whose levers lost to its grid on validation gets no run; seed 0 only). Carry .whl, .device-data and, for warm starts, .warm-cache.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_setup.sh /tmp/resnet20_full
common=(--device cuda --minutes "${1:-8}" --threads 4 --methods ${METHODS:-gep gp opacus}
  ${LEVERS:+--levers $LEVERS})
standard=(-- --dataset cifar10 --features raw --grid resnet --epsilon "${EPSILON:-8}" --tan 8
  --seed "${SEED:-0}" --data-dir "$data" "${warm_cache[@]}")
if [ $# -le 1 ]; then
  exec "$python" benchmarks/full_length.py "${common[@]}" --epochs 200 --out "$out" "${standard[@]}"
fi
pids=()
for epochs in "${@:2}"; do
  "$python" benchmarks/full_length.py "${common[@]}" --epochs "$epochs" --no-timing \
    --out "$out/e$epochs" "${standard[@]}" >"$out/e$epochs.out" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
tail -n 30 "$out"/e*.out
exit $rc
