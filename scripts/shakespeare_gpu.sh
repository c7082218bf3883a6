#!/usr/bin/env bash
# nanoGPT's shakespeare_char run (config/train_shakespeare_char.py) with AdamW and Muon on one CUDA GPU:
# 6 layers, 6 heads, width 384, context 256, batch 64, dropout 0.2, lr 1e-3 -> 1e-4 cosine over 5000 iterations,
# 100 warmup, beta2 0.99, weight decay 0.1, clip 1.0, val loss every 250 steps over 200 batches.
# nanoGPT reports val loss 1.4697 at 5000 iterations for AdamW.
#
#   bash scripts/shakespeare_gpu.sh                 # both optimizers; results copied to $OUT (or docs/results/)
#   OPTIMIZERS=adamw bash scripts/shakespeare_gpu.sh   # one at a time, if a call has a time limit; then rerun
#
# Runs are checkpointed every 500 steps under runs/shakespeare_char and resumed by a rerun, so a run cut short
# by a time limit continues where it stopped. MUON_LR sets Muon's peak lr; EXTRA adds flags (e.g. --compile).
set -euo pipefail
cd "$(dirname "$0")/.."

RUN=${RUN:-runs/shakespeare_char}
DEST=${OUT:-docs/results/shakespeare_char_gpu}
OPTIMIZERS=${OPTIMIZERS:-adamw,muon}
MUON_LR=${MUON_LR:-4e-3}
LRS=$(echo "$OPTIMIZERS" | tr ',' '\n' | sed "s/^adamw$/adamw=1e-3/; s/^muon$/muon=$MUON_LR/" | paste -sd, -)

python -m matrixopt compare --optimizers "$OPTIMIZERS" --lr "$LRS" \
  --model shakespeare-char --batch-size 64 --dropout 0.2 --steps 5000 --warmup 100 \
  --min-lr-ratio 0.1 --betas 0.9,0.99 --weight-decay 0.1 --grad-clip 1.0 \
  --eval-every 250 --eval-iters 200 --log-every 50 --ckpt-every 500 \
  --device cuda --no-progress --resume --out "$RUN" ${EXTRA:-}

mkdir -p "$DEST"
cp "$RUN"/summary.json "$RUN"/report.md "$RUN"/report.html "$RUN"/*.png "$DEST"/
for d in "$RUN"/*/; do
  name=$(basename "$d"); mkdir -p "$DEST/$name"
  cp "$d"config.json "$d"metrics.jsonl "$d"run.json "$DEST/$name"/
done
echo "results in $DEST"
