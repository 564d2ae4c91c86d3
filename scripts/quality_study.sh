#!/usr/bin/env bash
# The LCSB quality study of docs/RESULTS.md on the real base (SmolLM2-135M-Instruct), every number from `lcsb`:
#   bash scripts/quality_study.sh [OUT_DIR] [PART ...]      PART: diagnose | tasks | nf4 (default: all three)
# Environment: SEEDS (3), STEPS (40: lamp2 and qa; text takes STEPS/2 at a quarter of the batch), METHODS (the
# compared list), TASKS (lamp2 qa text), LRS (the 4-bit sweep's learning rates), OVERRIDES (KEY=VALUE for every
# command, e.g. train.batch_size=4), EVAL_STRIDE (LaMP-2: evaluate every Nth held-out question; 1, all 90). fp32 weights: this CPU has no native bf16 (bf16 matmuls are emulated, ~10x slower).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/study}
shift || true
PARTS=${*:-diagnose tasks nf4}
SEEDS=${SEEDS:-3}
STEPS=${STEPS:-40}
METHODS=${METHODS:-"full-backprop lcsb:4 lcsb:4:exact lcsb:2:exact freeze lisa mezo"}
TASKS=${TASKS:-"lamp2 qa text"}
LRS=${LRS:-"1e-4 3e-4 1e-3 3e-3"}
read -r -a overrides <<< "${OVERRIDES:-}"
EVAL_STRIDE=${EVAL_STRIDE:-1}
lamp2_eval=()
compare=()
for method in $METHODS; do compare+=(--compare "$method"); done
for part in $PARTS; do
  case $part in diagnose|tasks|nf4) ;; *) echo "unknown part $part: diagnose | tasks | nf4" >&2; exit 2 ;; esac
done
mkdir -p "$OUT"
if [ "$EVAL_STRIDE" != 1 ]; then  # every Nth LaMP-2 dev question (3 a user: stride 3 keeps one per user)
  python - "$OUT/lamp2-eval" "$EVAL_STRIDE" <<'PY'
import json, sys
from pathlib import Path
out, stride = Path(sys.argv[1]), int(sys.argv[2])
out.mkdir(exist_ok=True)
questions = json.loads(Path("recipes/data/lamp2/dev_questions.json").read_text())[::stride]
golds = {g["id"]: g for g in json.loads(Path("recipes/data/lamp2/dev_outputs.json").read_text())["golds"]}
(out / "dev_questions.json").write_text(json.dumps(questions))
(out / "dev_outputs.json").write_text(json.dumps({"task": "LaMP_2", "golds": [golds[q["id"]] for q in questions]}))
PY
  lamp2_eval=("data.eval=$OUT/lamp2-eval/dev_questions.json" "data.eval_labels=$OUT/lamp2-eval/dev_outputs.json")
fi
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
      for task in $TASKS; do
        steps=$STEPS
        args=("${overrides[@]}")
        [ "$task" = lamp2 ] && args+=("${lamp2_eval[@]}")
        [ "$task" = text ] && steps=$((STEPS / 2))
        log "base: $task"
        lcsb eval recipes/study/$task.yaml "${args[@]}" --output "$OUT/$task-base" > /dev/null
        for budget in equal-steps equal-time; do
          log "bench: $task $budget ($steps steps, $SEEDS seeds)"
          lcsb bench recipes/study/$task.yaml "${args[@]}" "${compare[@]}" --steps "$steps" --warmup 1 --seeds "$SEEDS" \
            --budget "$budget" --eval --output "$OUT/$task-$budget" > /dev/null
        done
      done ;;
    nf4)  # 4-bit stability on plain text (training loss and held-out perplexity): nf4 base, full backprop
          # against lcsb K=4 over four learning rates; no spike guard (a non-finite step is skipped and counted
          # as diverged), so a blow-up shows in the loss
      for lr in $LRS; do
        log "nf4: lr $lr"
        lcsb bench recipes/study/text.yaml "${overrides[@]}" quantization=nf4 train.lr=$lr divergence.action=skip \
          divergence.spike_factor=1e9 \
          --compare full-backprop --steps "$((STEPS / 2))" --warmup 1 --seeds "$SEEDS" --eval \
          --output "$OUT/nf4-lr$lr" > /dev/null
      done ;;
  esac
done
log "done"
