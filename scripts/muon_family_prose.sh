#!/usr/bin/env bash
# The Muon family on the prose benchmark (docs/results/prose/recipe.json): NorMuon, AdaMuon and Muon with cautious
# weight decay beside Muon and AdamW. Each call trains the listed runs one after another on one GPU (timed alone),
# into $RUN/seedSEED/NAME, then writes the comparison report there (AdamW's final loss is the target):
#
#   bash scripts/muon_family_prose.sh 1337 adamw=1e-3 muon=4e-3 normuon-2e-3=2e-3 muon-cautious-4e-3=4e-3
#
# NAME is OPTIMIZER[-cautious][-TAG]: the optimizer is its first word, "-cautious" sets weight_decay_mode=cautious,
# and the run named adamw is the baseline.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/muon_family}
DATA_DIR=${DATA_DIR:-../shared/data}
COMMON=(--config docs/results/prose/recipe.json --data "$DATA_DIR/prose_gpt2_train.u16.xz"
        --val-data "$DATA_DIR/prose_gpt2_val.u16.xz" --device "${DEVICE:-cuda}" --no-progress)
seed=${1:?usage: muon_family_prose.sh SEED NAME=LR ...}
shift
out="$RUN/seed$seed"
for entry in "$@"; do
  name=${entry%%=*} lr=${entry#*=} extra=()
  case "$name" in *-cautious*) extra=(--opt weight_decay_mode=cautious) ;; esac
  python -m matrixopt train --optimizer "${name%%-*}" --lr "$lr" --seed "$seed" --out "$out/$name" "${extra[@]}" \
    "${COMMON[@]}"
done
python -m matrixopt report "$out"
echo "results under $out"
