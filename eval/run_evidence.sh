#!/usr/bin/env bash
# Reproduce the compare tables quoted in the docs (docs/results.md) and the issues' closing notes.
# Each run: every scorer x {10, 25, 40, 50}% x {zero, mean}, one calibration pass,
# the same evaluation windows. Writes runs/compare-*/ (json, csv, md, png).
set -euo pipefail
cd "$(dirname "$0")/.."
for recipe in quickstart gpt2-shakespeare llama-shakespeare minilm-encoder; do
  extra=()
  # the llama recipe's per-layer budget is for compact saving; compare it with a global one
  [ "$recipe" = llama-shakespeare ] && extra=(--set selection.budget=global)
  pruner compare "recipes/$recipe.yaml" --out "runs/compare-$recipe" --overwrite \
    --set "capture.metrics=[cosine]" "${extra[@]}"
done
python eval/reference_plans.py gpt2-shakespeare llama-shakespeare --target 0.25 | tee runs/reference-plans.md
