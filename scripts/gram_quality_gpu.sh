#!/usr/bin/env bash
# Muon's Gram Newton–Schulz (the default, ns_method=auto) against the standard form in training: nanoGPT's
# shakespeare_char config (as scripts/shakespeare_gpu.sh) shortened to 1500 steps, same seed and flags, one CUDA GPU.
#
#   bash scripts/gram_quality_gpu.sh       # writes ${OUT:-docs/results/bench}/gram_quality_{auto,standard}/
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-docs/results/bench}
for m in auto standard; do
  python -m matrixopt train --optimizer muon --lr 4e-3 --opt ns_method=$m \
    --model shakespeare-char --batch-size 64 --dropout 0.2 --steps 1500 --warmup 100 \
    --min-lr-ratio 0.1 --betas 0.9,0.99 --weight-decay 0.1 --grad-clip 1.0 \
    --eval-every 250 --eval-iters 200 --log-every 250 --device cuda --no-progress --seed 0 \
    --out "$DEST/gram_quality_$m" --overwrite
  rm -f "$DEST/gram_quality_$m/ckpt.pt"
done
