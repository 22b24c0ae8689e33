#!/usr/bin/env bash
# Issues 14 and 15 on the causal all-MiniLM-L6-v2 (the shipped decoder with real sinks).
# 1. (issue 14) dev split first: which compensation to default to; then `pruner compare`, every scorer x
#    {25, 40, 50}% x {zero, mean, refit}, 256 evaluation windows of 128 tokens (perplexity CIs that separate
#    the scorers), and the target checks.
# 2. (issue 15) `pruner compare` with the shipped offline task suite (first 100 documents of each task) beside
#    perplexity (64 windows), every scorer x {25, 40, 50}% x {zero, mean, refit}, paired with the base on the
#    same windows and documents; do accuracy and perplexity rank the scorers alike. Resumable (--resume).
#
#   eval/run_quickstart_evidence.sh [refit] [tasks]      (default both; about 20 + 60 minutes on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(refit tasks)
for part in "${parts[@]}"; do
  case "$part" in
    refit)
      python eval/refit_study.py minilm-causal --windows 256 --targets 0.25,0.4,0.5 --scorers sink-aware,fluctuation \
        --comps zero,mean,refit --out eval/results/refit_study-minilm-causal.json
      python -m pruner.cli compare recipes/quickstart.yaml --out runs/evidence-refit --overwrite \
        --sparsities 0.25,0.4,0.5 --compensation zero,mean,refit \
        --set evaluation.num_samples=256 --set "capture.metrics=[cosine]" --set threads=2
      cp runs/evidence-refit/compare.json eval/results/refit_compare-quickstart.json
      cp runs/evidence-refit/compare.md eval/results/refit_compare-quickstart.md
      python eval/refit_tables.py --model quickstart | tee eval/results/refit_targets-quickstart.md ;;
    tasks)
      python -m pruner.cli compare recipes/quickstart.yaml --out runs/evidence-tasks --resume \
        --sparsities 0.25,0.4,0.5 --compensation zero,mean,refit \
        --set "capture.metrics=[cosine]" --set threads=2 \
        --set "evaluation.tasks=[shakespeare]" --set evaluation.task_limit=100
      cp runs/evidence-tasks/compare.json eval/results/tasks_compare-quickstart.json
      cp runs/evidence-tasks/compare.md eval/results/tasks_compare-quickstart.md
      python eval/task_ranks.py runs/evidence-tasks/compare.json | tee eval/results/task_ranks-quickstart.md
      python eval/task_ranks.py --cells runs/evidence-tasks/compare.json | tee eval/results/tasks_table-quickstart.md ;;
  esac
done
