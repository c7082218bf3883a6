#!/usr/bin/env bash
# One device call: the one-GPU bench rows a change must not slow (`matrixopt bench step` and `bench train`),
# measured for a base checkout and for this one, alternating row by row on the same GPU. JSON and tables under
# $OUT (default out/regression), base_*.json beside new_*.json.
# Usage (on the GPU machine, repo root): bash scripts/regression_gpu.sh BASE_DIR [step|train|all]
#   BASE_DIR: a copy of the base commit's matrixopt/ (e.g. `git archive BASE matrixopt | tar -x -C DIR`)
set -o pipefail
export PYTHONUNBUFFERED=1
BASE=${1:?usage: bash scripts/regression_gpu.sh BASE_DIR [step|train|all]}
WHAT=${2:-all}
OUT=${OUT:-out/regression}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() {  # run TAG ARGS...: `python -m matrixopt.bench ARGS` from the base (TAG base) or this checkout (TAG new)
  local tag=$1 root=.
  shift
  [ "$tag" = base ] && root=$BASE
  PYTHONPATH=$root timeout 240 python3 -m matrixopt.bench "$@" 2>&1 | tail -n 12 | tee -a "$OUT/$tag.md"
}
if [ "$WHAT" != train ]; then
  for m in gpt2-small gpt2-medium 1.3b; do
    for tag in base new; do
      run $tag step --model $m --json "$OUT/${tag}_step_$m.json" \
        --only "adamw (fused)" "matrixopt muon, deferred check, CUDA graph"
    done
  done
fi
if [ "$WHAT" != step ]; then
  for m in gpt2-small gpt2-medium; do
    for tag in base new; do
      run $tag train --model $m --json "$OUT/${tag}_train_$m.json" --optimizers adamw muon
    done
  done
fi
