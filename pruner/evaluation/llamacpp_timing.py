"""What pruning buys in llama.cpp: the base and the pruned model, each as a GGUF pruner writes, timed there.

Every round runs each file in a fresh process (`python -m pruner.evaluation.llamacpp_timing FILE CASES`),
base and pruned alternately, so a process's peak resident memory is one model's and a shared machine's
load falls on both alike; round 0 warms the file cache and is not kept. In a process (llama-cpp-python,
its default f16 KV cache, n_batch 2048, n_ubatch 512, every core): prefill = one `eval` of a T-token
prompt from an empty cache (tokens/s = T / seconds); decode = `eval` of one token at a time after a
P-token prompt at batch 1 (tokens/s = 1 / seconds per step); KV cache = the bytes per token of the cache
llama.cpp allocates (its own `llama_kv_cache: ... K (f16): .. MiB, V (f16): .. MiB` report divided by its
cells); memory = the process's peak resident set (VmHWM: llama.cpp maps the file, and the pages it reads
count) after the decode case. Ideals: `pruner.evaluation.ideal` from the PyTorch models' geometry, at
the GGUF's bytes per weight and llama.cpp's 2 bytes per cached key or value.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from pruner.core import environment
from pruner.evaluation.bench import BenchResult, Figure, heads_record, timed
from pruner.evaluation.ideal import decode_bytes, kv_bytes_per_token, prefill_flops, resident_bytes, saving, shape_of
from pruner.evaluation.rounds import interleaved, peak_kib, spawn
from pruner.evaluation.timing import BenchConfig, Timings

_KV = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells.*K \(f16\): +([\d.]+) MiB, V \(f16\): "
                 r"+([\d.]+) MiB")
KV_ITEMSIZE = 2  # llama.cpp's default cache type, f16


def measure_file(path: Path, cases: dict) -> dict:
    """One process's measurements of one GGUF: {"prefill": {T: s}, "decode": {P: s/step}, "peak_kib": ...}.
    `cases`: {"lengths": [...], "prompts": [...], "new_tokens": N, "vocab": V}."""
    import random

    from llama_cpp import Llama

    longest = max(cases["lengths"] + [p + cases["new_tokens"] for p in cases["prompts"]])
    n_ctx = 256 * -(-(longest + 8) // 256)
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=2048, n_ubatch=512, verbose=True,
                n_threads=os.cpu_count(), n_threads_batch=os.cpu_count())
    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(3, cases["vocab"]) for _ in range(n)]

    out = {"prefill": {}, "decode": {}}
    for T in cases["lengths"]:
        llm.reset()
        llm._ctx.kv_cache_clear()
        prompt = ids(T)
        t0 = time.perf_counter()
        llm.eval(prompt)
        out["prefill"][str(T)] = time.perf_counter() - t0
    for p in cases["prompts"]:
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(ids(p))
        steps = ids(cases["new_tokens"])
        t0 = time.perf_counter()
        for tok in steps:
            llm.eval([tok])
        out["decode"][f"1x{p}"] = (time.perf_counter() - t0) / len(steps)
    out["peak_kib"] = peak_kib()
    llm.close()
    return out


def _one(path: Path, cases: dict) -> dict:
    """One process's measurements of `path`, with the KV cache bytes per token llama.cpp reported."""
    got, stderr = spawn("pruner.evaluation.llamacpp_timing", path, cases, "llama.cpp")
    got["kv_per_token"] = kv_per_token(stderr, path)
    return got


def kv_per_token(stderr: str, path: Path) -> float:
    """The KV cache's bytes per token from llama.cpp's log: the sum over its caches -- one, or with sliding-window
    layers (Gemma 3's iSWA) one for the global layers and one for the windowed ones, each `size = ...` line."""
    caches = list(_KV.finditer(stderr))
    if not caches:
        raise RuntimeError(f"llama.cpp did not report its KV cache for {path} (llama_kv_cache: size = ...)")
    return sum((float(kv.group(3)) + float(kv.group(4))) * 2**20 / int(kv.group(2)) for kv in caches)


def measure(files: dict[str, Path], cfg: BenchConfig, vocab: int, progress: bool = False) -> dict[str, Timings]:
    """Interleaved rounds over fresh processes (`pruner.evaluation.rounds`); round 0 (warm-up) is dropped.
    Decode at batch 1 only: the prompts of `cfg.decode`'s batch-1 cases."""
    prompts = [p for b, p in cfg.decode if b == 1]
    cases = {"lengths": list(cfg.lengths), "prompts": prompts, "new_tokens": cfg.new_tokens, "vocab": vocab}
    return interleaved(files, cfg, [(1, p) for p in prompts], lambda path: _one(path, cases), "llama.cpp", progress)


def compare(base, pruned, files: dict[str, Path], cfg: BenchConfig, runs: dict[str, Timings],
            itemsize: int) -> BenchResult:
    """The figures of the pruned GGUF against the base's, each next to its ideal (the PyTorch models' geometry;
    `itemsize`: bytes per weight matrix entry in the files)."""
    from pruner.pruning import surgery

    sb = replace(shape_of(base), itemsize=itemsize)
    sp = replace(shape_of(base, surgery.kept_heads(pruned)), itemsize=itemsize)
    fb, fp = files["base"].stat().st_size, files["pruned"].stat().st_size
    rb, rp = runs["base"], runs["pruned"]
    kb, kp = replace(sb, itemsize=KV_ITEMSIZE), replace(sp, itemsize=KV_ITEMSIZE)
    figs = [Figure("GGUF file", "MB", fb / 1e6, fp / 1e6, saving(fb, fp), saving(sb.params, sp.params), "parameters"),
            Figure("KV cache", "bytes/token", rb.kv_per_token, rp.kv_per_token,
                   saving(rb.kv_per_token, rp.kv_per_token), saving(kv_bytes_per_token(kb), kv_bytes_per_token(kp)),
                   "KV heads")]
    for T in cfg.lengths:
        figs.append(timed(f"prefill T={T}", "tokens/s", rb.prefill[T], rp.prefill[T],
                          saving(prefill_flops(sb, T, 1), prefill_flops(sp, T, 1)), "FLOPs", throughput=T))
    for (b, p) in rb.decode:
        context = p + cfg.new_tokens / 2
        figs.append(timed(f"decode batch 1, prompt {p}", "tokens/s", rb.decode[(b, p)], rp.decode[(b, p)],
                          saving(decode_bytes(sb, 1, context), decode_bytes(sp, 1, context)), "bytes moved",
                          throughput=1))
    p = max(p for _, p in rb.decode)
    mb, mp = statistics.median(rb.memory), statistics.median(rp.memory)
    tokens = p + cfg.new_tokens
    figs.append(Figure(f"peak memory (batch 1, prompt {p})", "MB", mb / 1e6, mp / 1e6, saving(mb, mp),
                       saving(resident_bytes(sb, 0) + tokens * kv_bytes_per_token(kb),
                              resident_bytes(sp, 0) + tokens * kv_bytes_per_token(kp)), "weights + KV cache",
                       None, len(rb.memory)))
    conditions = {"runtime": "llama.cpp (llama-cpp-python)", "device": "cpu", "threads": os.cpu_count(),
                  "dtype": {4: "float32", 2: "float16 or bfloat16"}[itemsize], "repeats": cfg.repeats,
                  "new_tokens": cfg.new_tokens, "lengths": list(cfg.lengths), "decode": [[1, p] for _, p in rb.decode],
                  "load_average": [round(x, 2) for x in os.getloadavg()], **_llamacpp_version(),
                  **environment.versions(), **environment.machine()}
    return BenchResult(figs, heads_record(base, sb, sp), conditions)


def _llamacpp_version() -> dict:
    try:
        import llama_cpp

        return {"llama_cpp_python": llama_cpp.__version__}
    except ImportError:
        return {}


if __name__ == "__main__":
    print(json.dumps(measure_file(Path(sys.argv[1]), json.loads(sys.argv[2]))))
