#!/usr/bin/env bash
# Issue 34's evidence: shipped decoders pruned (refit-energy + refit, remove), recovered by `pruner recover` at
# several budgets, data, methods and teacher modes; perplexity on shakespeare:evaluation and
# python-docs:evaluation before and after, the damage recovered R, tokens/s against plain training, wall time
# and peak memory. Appends to eval/results/recovery/records.jsonl, writes eval/results/recovery/table.md
# (docs/recovery.md#evidence). Each config is MODEL:SPARSITY:DATA:TOKENS:METHOD:TEACHER (eval/recovery_study.py).
#
#   [OMP_NUM_THREADS=N] eval/run_recovery_evidence.sh [CONFIG ...]   (default: the set in the docs; about 20 minutes on 2
#                                                                     idle CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=(
  llama-shakespeare:0.5:generated:32768:full:resident
  llama-shakespeare:0.5:generated:32768:full:cached
  llama-shakespeare:0.5:shakespeare:train:32768:full:resident
  llama-shakespeare:0.5:generated:32768:lora:resident
  llama-shakespeare:0.5:generated:32768:attention:resident
  llama-shakespeare:0.25:generated:32768:full:resident
  gpt2-shakespeare:0.5:generated:32768:full:resident
  llama-shakespeare:0.5:generated:131072:full:resident
  gpt2-shakespeare:0.5:generated:131072:full:resident
  minilm-causal:0.5:generated:32768:full:resident
  minilm-causal:0.25:generated:65536:full:resident
)
python eval/recovery_study.py "${configs[@]}"
