#!/usr/bin/env bash
# The LCSB quality study of docs/RESULTS.md on the real base (SmolLM2-135M-Instruct), every number from `lcsb`:
#   bash scripts/quality_study.sh [OUT_DIR] [PART ...]      PART: diagnose | tasks | nf4 (default: all three)
# Environment: SEEDS (3), STEPS (40: lamp2 and qa; text takes STEPS/2 at half the batch), METHODS (the compared
# list). fp32 weights: this CPU has no native bf16 (bf16 matmuls are emulated, ~10x slower).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/study}
shift || true
PARTS=${*:-diagnose tasks nf4}
SEEDS=${SEEDS:-3}
STEPS=${STEPS:-40}
METHODS=${METHODS:-"full-backprop lcsb:2 lcsb:4:exact lcsb:4:exact8 lcsb:2:exact freeze lisa mezo"}
compare=()
for method in $METHODS; do compare+=(--compare "$method"); done
for part in $PARTS; do
  case $part in diagnose|tasks|nf4) ;; *) echo "unknown part $part: diagnose | tasks | nf4" >&2; exit 2 ;; esac
done
mkdir -p "$OUT"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/study.log"; }

for part in $PARTS; do
  case $part in
    diagnose)  # the surrogate gradient against the true one, per block and exact window (one batch of 8)
      for task in lamp2 text; do
        log "surrogate cosine: $task"
        python scripts/surrogate_cosine.py recipes/study/$task.yaml train.batch_size=8 --blocks 4 \
          --windows 0 2 4 8 16 --json "$OUT/surrogate-$task.json" | tee "$OUT/surrogate-$task.md"
      done ;;
    tasks)  # the paper's three task kinds, every method, equal steps and equal time, SEEDS seeds
      for task in lamp2 qa text; do
        steps=$STEPS
        [ "$task" = text ] && steps=$((STEPS / 2))
        log "base: $task"
        lcsb eval recipes/study/$task.yaml --output "$OUT/$task-base" > /dev/null
        for budget in equal-steps equal-time; do
          log "bench: $task $budget ($steps steps, $SEEDS seeds)"
          lcsb bench recipes/study/$task.yaml "${compare[@]}" --steps "$steps" --warmup 1 --seeds "$SEEDS" \
            --budget "$budget" --eval --output "$OUT/$task-$budget" > /dev/null
        done
      done ;;
    nf4)  # 4-bit stability: nf4 base, full backprop against lcsb K=4 over four learning rates; no spike
          # guard (a non-finite step is skipped and counted as diverged), so a blow-up shows in the loss
      for lr in 1e-4 3e-4 1e-3 3e-3; do
        log "nf4: lr $lr"
        lcsb bench recipes/study/lamp2.yaml quantization=nf4 train.lr=$lr divergence.action=skip \
          divergence.spike_factor=1e9 \
          --compare full-backprop --steps "$STEPS" --warmup 1 --seeds "$SEEDS" --eval \
          --output "$OUT/nf4-lr$lr" > /dev/null
      done ;;
  esac
done
log "done"
