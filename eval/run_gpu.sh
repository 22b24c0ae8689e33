#!/usr/bin/env bash
# Issue 17 item 3 on a CUDA machine (one GPU). Nothing is downloaded; results under OUT_DIR.
#   bench    calibration of a Llama-3-8B-shaped random model, bfloat16, 128 windows x 2048 tokens in batches
#            of 8, against plain forward passes over the same windows, and the gradient scorer's pass;
#   batch4   the same model, 32 windows in batches of 4: what a smaller batch does to calibration's memory;
#   profile  the top operators of one calibrate batch (8 x 2048) of that model;
#   small    the CPU table's sizes (Qwen2.5-0.5B and Llama-3.2-1B shapes, 16 x 1024) on the GPU;
#   check    the pipeline on the GPU gives the CPU's plans and perplexities, and the compact export
#            reload-checks there (eval/gpu_check.py, the shipped from-scratch GPT-2 and Llama);
#   recovery issue 34 item 11: recovery on the GPU gives the CPU's validation KL (the shipped Llama), then the
#            Llama-3.2-1B shape, full and lora, teacher resident and cached: tokens/s and peak memory against the
#            estimate (eval/gpu_recovery.py).
#
#   eval/run_gpu.sh OUT_DIR [bench] [batch4] [profile] [small] [check] [recovery]   (default: all; ~12 min on an H200)
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(bench batch4 profile small check recovery)
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
bench="timeout 300 python3 eval/bench_calibrate.py --device cuda --threads 8"
for part in "${parts[@]}"; do
  echo "== $part  $(date -u +%H:%M:%S)"
  mkdir -p "$out/$part"
  case "$part" in
    bench)   $bench --model llama-3-8b --windows 128 --length 2048 --repeats 2 --out "$out/$part" ;;
    batch4)  $bench --model llama-3-8b --windows 32 --length 2048 --batch-size 4 --cases plain,calibrate \
               --out "$out/$part" ;;
    profile) $bench --model llama-3-8b --windows 8 --length 2048 --cases calibrate --profile --out "$out/$part" ;;
    small)   $bench --repeats 3 --out "$out/$part" ;;
    check)   timeout 240 python3 eval/gpu_check.py --out "$out/$part" ;;
    recovery) timeout 400 python3 eval/gpu_recovery.py --out "$out/$part" ;;
  esac 2>&1 | grep -v "Loading weights\|Writing model shards" | tee "$out/$part.log"
done
echo "== done  $(date -u +%H:%M:%S)"
