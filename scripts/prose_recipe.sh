#!/usr/bin/env bash
# Issue 8's benchmark: a GPT of ~19M non-embedding parameters (6 layers, width 512, context 1024, tied 50304-token
# embedding) trained for one pass over the 18.7M-token prose corpus (1144 steps of 16 x 1024 tokens), warmup
# then cosine decay to zero (docs/results/prose/recipe.json). Each optimizer is swept over its lr grid, the best
# run of each sweep is compared against AdamW's best (target = AdamW's final val loss), then the best lrs are
# rerun with a second seed for the spread.
#
#   bash scripts/prose_recipe.sh                      # everything, on CUDA; results under runs/prose
#   OPTIMIZERS="adamw muon" bash scripts/prose_recipe.sh
#   DATA_DIR=path/to/data SEED2=0 bash scripts/prose_recipe.sh   # data elsewhere; skip the second seed
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/prose}
DATA_DIR=${DATA_DIR:-../shared/data}
OPTIMIZERS=${OPTIMIZERS:-adamw muon soap shampoo}
SEED2=${SEED2:-1338}
declare -A GRID=(
  [adamw]=${LRS_ADAMW:-5e-4,1e-3,2e-3,4e-3}
  [muon]=${LRS_MUON:-2e-3,4e-3,8e-3,1.6e-2}
  [soap]=${LRS_SOAP:-1e-3,2e-3,4e-3,8e-3,1.6e-2}
  [shampoo]=${LRS_SHAMPOO:-5e-4,1e-3,2e-3,4e-3}
)
DATA=(--data "$DATA_DIR/prose_gpt2_train.u16.xz" --val-data "$DATA_DIR/prose_gpt2_val.u16.xz")
COMMON=(--config docs/results/prose/recipe.json "${DATA[@]}" --device "${DEVICE:-cuda}" --no-progress --resume)

sweeps=()
for opt in $OPTIMIZERS; do
  python -m matrixopt sweep --optimizer "$opt" --lrs "${GRID[$opt]}" --out "$RUN/sweep-$opt" "${COMMON[@]}" ${EXTRA:-}
  sweeps+=("$RUN/sweep-$opt")
done
python -m matrixopt compare-sweeps "${sweeps[@]}" --out "$RUN/best-seed1337" --overwrite

if [ "$SEED2" != 0 ]; then
  lrs=$(python -c "import json,sys; print(','.join(f\"{o}={json.load(open(f'$RUN/sweep-{o}/sweep.json'))['best']['lr']}\" for o in sys.argv[1:]))" $OPTIMIZERS)
  python -m matrixopt compare --optimizers "$(echo $OPTIMIZERS | tr ' ' ',')" --lr "$lrs" --seed "$SEED2" \
    --out "$RUN/best-seed$SEED2" "${COMMON[@]}" ${EXTRA:-}
fi
echo "results under $RUN"
