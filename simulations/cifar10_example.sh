#!/usr/bin/env bash
# The CIFAR-10 worked example: 3 simulated sites (IID) on CIFAR-10 batches 1-2, ResNet20-GN,
# Tiny-ImageNet anchors, epsilon 8, central then client-side mode. About 50 minutes per mode on
# 2 shared CPU cores. Settings are not tuned (see issue 13 for the tuned benchmarks).
#   simulations/cifar10_example.sh [DATA_DIR] [RUN_DIR]
set -euo pipefail
data=${1:-../shared/data}
runs=${2:-runs/cifar10}
for mode in central client; do
  if [ "$mode" = central ]; then lr=0.1; momentum=0.9; else lr=1.0; momentum=0.0; fi
  gep-fed simulate --task cifar10 --model resnet20 --data-dir "$data" --mode "$mode" \
    --target-epsilon 8 --server-momentum "$momentum" --local-momentum 0 \
    --rounds 60 --local-steps 3 --sample-rate 0.05 --num-basis 500 --num-anchors 1000 \
    --basis-refresh 5 --clip-embedding 5 --clip-residual 2 --clip-norm 1 --server-lr "$lr" \
    --local-lr 0.1 --num-public 2000 --run-dir "$runs" \
    --run-name "cifar10-$mode"
done
