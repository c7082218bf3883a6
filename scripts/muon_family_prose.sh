#!/usr/bin/env bash
# The Muon family on the prose benchmark (docs/results/prose/recipe.json): NorMuon, AdaMuon and Muon with cautious
# weight decay beside Muon and AdamW. Two phases, each one device call:
#
#   bash scripts/muon_family_prose.sh sweeps          # the three variants' lr grids, run side by side on one GPU
#   bash scripts/muon_family_prose.sh best 1337 LRS   # the best lrs alone (timed), e.g. LRS="normuon=4e-3,..."
#
# The sweeps share the GPU (three processes), so only their losses count; the "best" phase trains each optimizer at
# its best lr alone, one after another, for steps and seconds to AdamW's final loss. Results under $RUN.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/muon_family}
DATA_DIR=${DATA_DIR:-../shared/data}
GRID=${GRID:-2e-3,4e-3,8e-3}
COMMON=(--config docs/results/prose/recipe.json --data "$DATA_DIR/prose_gpt2_train.u16.xz"
        --val-data "$DATA_DIR/prose_gpt2_val.u16.xz" --device "${DEVICE:-cuda}" --no-progress)
case "${1:?usage: muon_family_prose.sh sweeps | best SEED LRS}" in
  sweeps)
    python -m matrixopt sweep --optimizer normuon --lrs "$GRID" --out "$RUN/sweep-normuon" "${COMMON[@]}" &
    python -m matrixopt sweep --optimizer adamuon --lrs "$GRID" --out "$RUN/sweep-adamuon" "${COMMON[@]}" &
    python -m matrixopt sweep --optimizer muon --opt weight_decay_mode=cautious --lrs "$GRID" \
      --out "$RUN/sweep-muon-cautious" "${COMMON[@]}" &
    wait
    ;;
  best)
    seed=${2:?seed}
    lrs=${3:?LRS: name=lr,... for adamw muon normuon adamuon muon-cautious}
    out="$RUN/best-seed$seed"
    for entry in ${lrs//,/ }; do
      name=${entry%%=*} lr=${entry#*=} extra=()
      opt=$name
      if [ "$name" = muon-cautious ]; then opt=muon extra=(--opt weight_decay_mode=cautious); fi
      python -m matrixopt train --optimizer "$opt" --lr "$lr" --seed "$seed" --out "$out/$name" "${extra[@]}" \
        "${COMMON[@]}"
    done
    python -m matrixopt report "$out"
    ;;
esac
echo "results under $RUN"
