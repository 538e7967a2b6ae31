#!/usr/bin/env bash
# Issue 54 on one GPU, sized for 10 minutes of an H100 (not yet run): ResNet20-GN on CIFAR-10
# at epsilon 8, GEP with its untried levers against GP.
#
# 1. (about 3 min) GEP's levers on validation, each on top of GEP's grid winner (S1 0.1,
#    S2/S1 0.5, lr 4, wd 1e-4, k 1000, 2,000 anchors, refresh 20; 15 epochs, TAN 8, seed 0:
#    the grid's own length, TAN and seed), one process per lever, side by side on the GPU:
#    S2/S1 0.2 (the paper's) and 0.8 (the winner on Fashion-MNIST, where 0.2 and 0.1 lost);
#    lr x wd 1e-5 (the GEP paper's) and 1e-4 (GP's: lr 1, wd 1e-4);
#    S2/S1 0.2 with lr x wd 1e-4; a subspace every 5 steps, warm-started with memory 0.8 on
#    500 anchors (benchmarks/warm_refresh.py).
# 2. (about 4 min) the lever that beat GEP's grid on validation by the most, retrained at the
#    real batch (TAN 1) for 56 epochs and tested once on CIFAR-10 batch 5 (standard.py --stage
#    levers --lever-final --final-epochs 56). Its comparison is already logged: GP's grid
#    winner at 56 epochs, 55.14 % (H200, seed 0), and GEP's, 53.42 %.
#
# New records land in $OUT/levers.jsonl (append them to benchmarks/results/standard/cifar10.jsonl
# to tabulate), each process's output in $OUT/<name>.log. Carry .whl and .device-data where
# the device lacks them (benchmarks/device_setup.sh).
#   bash benchmarks/resnet20_levers_gpu.sh [SECONDS_STEP1] [SECONDS_STEP2]   (default 210 330)
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_setup.sh /tmp/resnet20_levers
log=benchmarks/results/standard/cifar10.jsonl
work=/tmp/resnet20_levers-work
common=(--dataset cifar10 --features raw --grid resnet --epsilon 8 --methods gep
  --stage levers --tan 8 --grid-tan 8 --seed 0 --device cuda --threads 2
  --checkpoints "$work/checkpoints" --data-dir "$data" "${warm_cache[@]}")
levers=("s2_ratio=0.2" "s2_ratio=0.8" "lr_wd=1e-05" "lr_wd=0.0001"
  "s2_ratio=0.2 lr_wd=0.0001" "refresh=5 anchors=500 warm_memory=0.8")
pids=()
folders=()
for i in "${!levers[@]}"; do
  folder=$work/lever$i
  mkdir -p "$folder"
  cp "$log" "$folder/"
  # shellcheck disable=SC2086  # each entry is one lever's knob=value items
  timeout "${1:-210}" "$python" benchmarks/standard.py "${common[@]}" --out "$folder" \
    --levers ${levers[$i]} --lever-exact >"$out/lever$i.log" 2>&1 &
  pids+=($!)
  folders+=("$folder")
done
for pid in "${pids[@]}"; do wait "$pid" || true; done
# every lever's record in one log, from which step 2 chooses
merged=$work/final
mkdir -p "$merged"
cp "$log" "$merged/"
for folder in "${folders[@]}"; do
  tail -n +"$(($(wc -l <"$log") + 1))" "$folder/cifar10.jsonl"
done >>"$merged/cifar10.jsonl"
grep -h -- "->" "$out"/lever*.log || true
rc=0
timeout "${2:-330}" "$python" benchmarks/standard.py "${common[@]}" --out "$merged" \
  --levers s2_ratio=0.2 s2_ratio=0.8 lr_wd=1e-05 lr_wd=0.0001 anchors=500 \
  --lever-final --logged-levers --final-epochs 56 >"$out/final.log" 2>&1 || rc=$?
tail -n +"$(($(wc -l <"$log") + 1))" "$merged/cifar10.jsonl" >"$out/levers.jsonl"
grep -h -- "->\|no lever" "$out/final.log" || true
echo "$(wc -l <"$out/levers.jsonl") new records in $out/levers.jsonl (step 2 exit $rc)"
exit $rc
