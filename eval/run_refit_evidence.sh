#!/usr/bin/env bash
# Issue 14's evidence: `pruner compare` on every shipped decoder and the all-MiniLM-L6-v2 encoder,
# every scorer x {10, 25, 40, 50}% x {zero, mean, refit}, 256 evaluation windows (lines for the
# encoder: 512, the recipe's), one calibration pass per model. Writes runs/refit-compare-*/ and
# copies compare.json / compare.md into eval/results/; eval/refit_tables.py prints the target checks.
#
#   [THREADS=N] eval/run_refit_evidence.sh [recipe ...]   (default: all four; hours on 2 shared CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
recipes=("$@")
[ ${#recipes[@]} -eq 0 ] && recipes=(gpt2-shakespeare llama-shakespeare quickstart minilm-encoder)
for recipe in "${recipes[@]}"; do
  extra=(--set evaluation.num_samples=256)
  # the llama recipe's per-layer budget is for compact saving; compare it with a global one
  [ "$recipe" = llama-shakespeare ] && extra+=(--set selection.budget=global)
  # the encoder recipe already evaluates 512 lines
  [ "$recipe" = minilm-encoder ] && extra=()
  python -m pruner.cli compare "recipes/$recipe.yaml" --out "runs/refit-compare-$recipe" --overwrite \
    --compensation zero,mean,refit --set "capture.metrics=[cosine]" --set threads="${THREADS:-2}" "${extra[@]}"
  cp "runs/refit-compare-$recipe/compare.json" "eval/results/refit_compare-$recipe.json"
  cp "runs/refit-compare-$recipe/compare.md" "eval/results/refit_compare-$recipe.md"
done
python eval/refit_tables.py
