"""What pruning buys in ONNX Runtime GenAI: the base and the compact model, each as the GenAI builder writes it.

Every round runs each model in a fresh process (`python -m pruner.evaluation.onnx_timing FOLDER CASES`),
base and pruned alternately, so the peak resident memory of a process is one model's and a shared
machine's load falls on both alike; round 0 warms the file cache and is not kept. In a process:
prefill = `append_tokens` of a T-token prompt at batch 1 (the pass that fills the KV cache and gives the
last position's logits); decode = `generate_next_token` steps after a P-token prompt at batch B, seconds
per step; memory = the process's peak resident set (VmHWM) after the largest decode case. Figures and
their ideals are those of `pruner.evaluation.bench`, from the PyTorch models' geometry.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from pruner.core import environment
from pruner.evaluation.bench import BenchResult, Figure, heads_record, timed
from pruner.evaluation.ideal import decode_bytes, prefill_flops, resident_bytes, saving, shape_of
from pruner.evaluation.rounds import interleaved, peak_kib, spawn
from pruner.evaluation.timing import BenchConfig, Timings


def measure_folder(folder: Path, cases: dict) -> dict:
    """One process's measurements of one GenAI model folder: {"prefill": {T: s}, "decode": {"BxP": s/step},
    "peak_kib": ...}. `cases`: {"lengths": [...], "decode": [[B, P], ...], "new_tokens": N, "vocab": V}."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    rng = np.random.default_rng(0)

    def ids(b, t):
        return rng.integers(3, cases["vocab"], size=(b, t), dtype=np.int32)

    def generator(batch: int, length: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=batch)
        return og.Generator(model, params)

    out = {"prefill": {}, "decode": {}}
    for T in cases["lengths"]:
        gen, prompt = generator(1, T + 1), ids(1, T)
        t0 = time.perf_counter()
        gen.append_tokens(prompt)
        out["prefill"][str(T)] = time.perf_counter() - t0
    for b, p in cases["decode"]:
        gen = generator(b, p + cases["new_tokens"])
        gen.append_tokens(ids(b, p))
        gen.generate_next_token()  # the first step follows the prompt: not a cached step
        t0 = time.perf_counter()
        steps = 0
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
        out["decode"][f"{b}x{p}"] = (time.perf_counter() - t0) / max(steps, 1)
    out["peak_kib"] = peak_kib()
    return out


def measure(folders: dict[str, Path], cfg: BenchConfig, vocab: int, progress: bool = False) -> dict[str, Timings]:
    """Interleaved rounds over fresh processes (`pruner.evaluation.rounds`); round 0 (warm-up) is dropped."""
    cases = {"lengths": list(cfg.lengths), "decode": [list(c) for c in cfg.decode], "new_tokens": cfg.new_tokens,
             "vocab": vocab}

    def one(folder):
        return spawn("pruner.evaluation.onnx_timing", folder, cases, "ONNX Runtime GenAI")[0]

    return interleaved(folders, cfg, [tuple(c) for c in cfg.decode], one, "onnxruntime-genai", progress)


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith("model.onnx"))


def compare(base, pruned, folders: dict[str, Path], cfg: BenchConfig, runs: dict[str, Timings],
            itemsize: int) -> BenchResult:
    """The figures of the pruned GenAI model against the base's, each next to its ideal (the PyTorch models'
    geometry; `itemsize`: bytes per weight in the ONNX files)."""
    from pruner.pruning import surgery

    sb = shape_of(base)
    sp = shape_of(base, surgery.kept_heads(pruned))
    fb, fp = _bytes(folders["base"]), _bytes(folders["pruned"])
    rb, rp = runs["base"], runs["pruned"]
    figs = [Figure("model files", "MB", fb / 1e6, fp / 1e6, saving(fb, fp), saving(sb.params, sp.params),
                   "parameters")]
    for T in cfg.lengths:
        figs.append(timed(f"prefill T={T}", "ms", rb.prefill[T], rp.prefill[T],
                           saving(prefill_flops(sb, T, 1), prefill_flops(sp, T, 1)), "FLOPs"))
    for b, p in cfg.decode:
        context = p + cfg.new_tokens / 2
        figs.append(timed(f"decode batch {b}, prompt {p}", "tokens/s", rb.decode[(b, p)], rp.decode[(b, p)],
                           saving(decode_bytes(sb, b, context), decode_bytes(sp, b, context)), "bytes moved",
                           throughput=b))
    b, p = max(cfg.decode, key=lambda c: c[0] * c[1])
    tokens = b * (p + cfg.new_tokens)
    mb, mp = statistics.median(rb.memory), statistics.median(rp.memory)
    wb, wp = replace(sb, itemsize=itemsize), replace(sp, itemsize=itemsize)
    figs.append(Figure(f"peak memory (batch {b}, prompt {p})", "MB", mb / 1e6, mp / 1e6, saving(mb, mp),
                       saving(resident_bytes(wb, tokens), resident_bytes(wp, tokens)), "weights + KV cache",
                       None, len(rb.memory)))
    heads = heads_record(base, sb, sp)
    conditions = {"runtime": "onnxruntime-genai", "device": "cpu", "dtype": {4: "float32", 2: "float16"}[itemsize],
                  "repeats": cfg.repeats, "new_tokens": cfg.new_tokens, "lengths": list(cfg.lengths),
                  "decode": [list(c) for c in cfg.decode], **environment.versions(), **environment.machine()}
    return BenchResult(figs, heads, conditions)


if __name__ == "__main__":
    print(json.dumps(measure_folder(Path(sys.argv[1]), json.loads(sys.argv[2]))))
