#!/usr/bin/env bash
# One device call: the GPU kernel tests, then `matrixopt bench ns|step|train|kernels` on one GPU, JSON and tables
# under $OUT (default out/bench). The multi-GPU benchmarks run under torchrun:
#   torchrun --standalone --nproc-per-node N -m matrixopt bench scale --json "$OUT/scale.json"
#   torchrun --standalone --nproc-per-node N -m matrixopt bench tp --json "$OUT/tp.json"
# Usage (on the GPU machine, repo root): bash scripts/gpu_bench.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/bench}
mkdir -p "$OUT"
B="timeout 170 python3 -m matrixopt.bench"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 120 python3 -m pytest tests/kernels -q -x 2>&1 | tail -3
$B ns --json "$OUT/ns.json" 2>&1 | tee "$OUT/ns.md"
$B step --model gpt2-small --json "$OUT/step_gpt2-small.json" 2>&1 | tee "$OUT/step.md"
for m in gpt2-medium 1.3b; do
  $B step --model $m --json "$OUT/step_$m.json" \
    --only "adamw (fused)" "torch.optim.Muon" "emerging_optimizers Muon" "matrixopt muon" "matrixopt muon, cuBLAS only" \
    2>&1 | tee -a "$OUT/step.md"
done
for m in gpt2-small gpt2-medium; do
  $B train --model $m --json "$OUT/train_$m.json" 2>&1 | tee -a "$OUT/train.md"
done
timeout 900 python3 -m matrixopt.bench kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.md"
