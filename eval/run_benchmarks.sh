#!/usr/bin/env bash
# The benchmark tables of docs/scaling.md and docs/what-pruning-buys.md (issues 13 and 17), in sequence on a quiet machine; each script prints its
# tables and writes JSON under eval/results/. Times measured 2026-11-30 on 2 CPU cores (see docs/scaling.md).
#
#   eval/run_benchmarks.sh [capture] [calibrate] [pruned]      (default: all three)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(capture calibrate pruned)
for part in "${parts[@]}"; do
  echo "== $part  $(date -u +%H:%M:%S)  load $(cut -d' ' -f1-3 /proc/loadavg)"
  case "$part" in
    capture)    # issue 17 item 1: the whole calibrate call vs a plain forward, GPT-2-small shape, batch 1
      python eval/bench_capture.py --models gpt2-small-random --lengths 1024,2048 \
        --modes plain,calibrate,capture_cos,capture_se,capture,capture_sdpa --repeats 5 \
        --out eval/results/capture ;;
    calibrate)  # issue 17 item 2: Qwen2.5-0.5B and Llama-3.2-1B shapes, bfloat16, 16 x 1024
      python eval/bench_calibrate.py --out eval/results ;;
    pruned)     # issue 13 item 3: what removing heads buys at real shapes, base vs compact in one process
      python eval/bench_pruned.py --models gpt2-small,qwen2.5-0.5b --lengths 512,2048 --decode 1x32,8x512 \
        --new-tokens 32 --repeats 5 --out eval/results
      python eval/bench_pruned.py --models llama-3.2-1b --targets 0.5 --lengths 512,2048 --decode 1x32,8x512 \
        --new-tokens 32 --repeats 5 --out eval/results --append ;;
  esac
done
echo "== done  $(date -u +%H:%M:%S)  load $(cut -d' ' -f1-3 /proc/loadavg)"
