#!/usr/bin/env bash
# Issue 23's levers at more seeds or at the real batch, on one GPU, as the device tool runs
# it: for each SEED and method, the method's grid winner on ResNet20-GN (tuned at seed 0,
# TAN 8; epsilon 8, validation only) runs again at that seed beside its levers that set one of
# LEVERS (default: warm; e.g. LEVERS="aug past ema") (standard.py --stage levers --levers
# LEVERS --seed SEED --grid-tan 8), every seed and method side by side; nothing is tested. TAN (default 8) sets the runs' TAN: TAN=1 runs them at
# the real batch. The warm starts come from the carried .warm-cache (the same for every seed).
# Runs stop starting after MINUTES; a rerun resumes. New records land in
# $OUT/lever_seeds.jsonl (append them to benchmarks/results/standard/cifar10.jsonl), the
# output of each seed and method in $OUT/<method>-<SEED>.log.
#   [TAN=1] [METHODS="gep gp"] [LEVERS="warm"] bash benchmarks/lever_seeds_gpu.sh MINUTES SEED...
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_setup.sh /tmp/lever_seeds
log=benchmarks/results/standard/cifar10.jsonl
pids=()
works=()
for seed in "${@:2}"; do
  for method in ${METHODS:-gep gp}; do
    work=/tmp/lever_seeds-work/$method-$seed
    mkdir -p "$work"
    cp "$log" "$work/"
    "$python" benchmarks/standard.py --dataset cifar10 --features raw --grid resnet \
      --epsilon 8 --tan "${TAN:-8}" --grid-tan 8 --methods "$method" --stage levers \
      --levers ${LEVERS:-warm} --seed "$seed" --device cuda --threads 4 --budget-minutes "$1" \
      --data-dir "$data" --out "$work" "${warm_cache[@]}" >"$out/$method-$seed.log" 2>&1 &
    pids+=($!)
    works+=("$work")
  done
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for work in "${works[@]}"; do
  tail -n +"$(($(wc -l <"$log") + 1))" "$work/cifar10.jsonl"
done >"$out/lever_seeds.jsonl"
grep -H -- "->" "$out"/*.log || true
exit $rc
