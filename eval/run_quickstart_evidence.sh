#!/usr/bin/env bash
# Issues 14 and 15 on the causal all-MiniLM-L6-v2 (the shipped decoder with real sinks): one `pruner compare`,
# every scorer x {25, 40, 50}% x {zero, mean, refit}, 256 evaluation windows of 128 tokens (perplexity CIs
# that separate the scorers) and the shipped offline task suite (first 100 documents of each task), paired with
# the base on the same windows and documents. Then the issue-14 target checks and the issue-15 rank agreement.
#
#   eval/run_quickstart_evidence.sh          (about an hour on 2 quiet CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# development split first (calibration plays 1-2 calibrate, plays 3-4 evaluate): which compensation to default to
python eval/refit_study.py minilm-causal --windows 256 --targets 0.25,0.4,0.5 --scorers sink-aware,fluctuation \
  --comps zero,mean,refit --out eval/results/refit_study-minilm-causal.json
out=runs/evidence-quickstart
python -m pruner.cli compare recipes/quickstart.yaml --out "$out" --overwrite \
  --sparsities 0.25,0.4,0.5 --compensation zero,mean,refit \
  --set evaluation.num_samples=256 --set "capture.metrics=[cosine]" --set threads=2 \
  --set "evaluation.tasks=[shakespeare]" --set evaluation.task_limit=100
cp "$out/compare.json" eval/results/refit_compare-quickstart.json
cp "$out/compare.md" eval/results/evidence-quickstart.md
python eval/refit_tables.py --model quickstart | tee eval/results/refit_targets-quickstart.md
python eval/task_ranks.py "$out/compare.json" | tee eval/results/task_ranks-quickstart.md
