#!/usr/bin/env bash
# The convention audits reported in eval/analyze_results.md (issue 6), written to runs/analyze/.
# One CPU thread per run (a shared machine).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=runs/analyze
T=(--threads 1 --overwrite)

# all-MiniLM-L6-v2 encoder: one sample per line, [CLS]/[SEP] (every special token) as sinks
python -m pruner.cli analyze minilm --sinks special --unit lines --num-samples 256 --max-length 128 \
  --out $OUT/minilm "${T[@]}"
# causal all-MiniLM-L6-v2 and the two from-scratch decoders: 64 windows of 128 tokens, first token as sink
for m in minilm-causal gpt2-shakespeare llama-shakespeare; do
  python -m pruner.cli analyze $m --num-samples 64 --max-length 128 --out $OUT/$m "${T[@]}"
done
# paired states: the same windows through the state before and after
python -m pruner.cli analyze minilm-causal --compare-to minilm-causal-init --num-samples 64 --max-length 128 \
  --out $OUT/minilm-causal-vs-init "${T[@]}"
python -m pruner.cli analyze llama-shakespeare --compare-to llama-shakespeare-early --num-samples 64 \
  --max-length 128 --out $OUT/llama-vs-early "${T[@]}"
