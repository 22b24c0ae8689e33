#!/usr/bin/env bash
# Issue 26's evidence: `pruner compare` on every shipped decoder, every scorer (the published BOS-sink and
# output-norm criteria and the measured single-head ablation included) x {10, 25, 40, 50}% x {zero, mean,
# refit (ridge auto)}, on two kinds of text: the evaluation plays (shakespeare:evaluation) and the Python
# standard library's docstrings (python-docs:evaluation), 256 windows of 128 tokens each, calibrated on the
# recipe's calibration plays. Writes runs/domains/<recipe>-<domain>/ and copies compare.json into
# eval/results/domains/; eval/domain_tables.py prints the tables and the target checks.
#
#   [THREADS=N] eval/run_domain_evidence.sh [recipe ...]   (default: the three decoders; hours on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
recipes=("$@")
[ ${#recipes[@]} -eq 0 ] && recipes=(gpt2-shakespeare llama-shakespeare quickstart)
mkdir -p eval/results/domains
for recipe in "${recipes[@]}"; do
  for domain in shakespeare:evaluation python-docs:evaluation; do
    name="$recipe-${domain%%:*}"
    extra=(--set evaluation.num_samples=256 --set "evaluation.data=$domain")
    # the llama recipe's per-layer budget is for compact saving; compare it with a global one
    [ "$recipe" = llama-shakespeare ] && extra+=(--set selection.budget=global)
    python -m pruner.cli compare "recipes/$recipe.yaml" --out "runs/domains/$name" --overwrite \
      --compensation zero,mean,refit --set "capture.metrics=[cosine]" --set threads="${THREADS:-2}" "${extra[@]}"
    cp "runs/domains/$name/compare.json" "eval/results/domains/$name.json"
  done
done
python eval/domain_tables.py | tee eval/results/domains/tables.md
