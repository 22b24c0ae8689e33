"""What pruning buys in llama.cpp (issue 32): base vs pruned GGUF at the Llama-3.2-1B shape, and the vanilla checks.

    python -m eval.bench.runtime_gguf                  # the tables of docs/what-pruning-buys.md
    python -m eval.bench.runtime_gguf --repeats 2 --skip-checks --out runs/bench/runtime_gguf.json
    python -m eval.bench.runtime_gguf --sizes-only --out runs/bench/gguf_sizes.json   # no llama-cpp-python needed

Model: random weights of the public Llama-3.2-1B config (`eval.common.random_model`, float32 in memory).
Plans from `random` scores through the usual selection (which heads go does not change what removing them
buys): 50% of heads as whole KV groups (`group`, 16 of 32 heads over 4 of 8 KV heads in every layer), 25%
uniform keeping every KV head (24 heads: a count Llama's config refuses, so a vanilla `MistralForCausalLM`),
and 25% with layers that differ (llama.cpp's `deci`: 16, 8, 8 and 0 of 32 heads removed in turn, taken evenly
from the KV groups -- what a global budget gives; on random weights the global selection spreads the cut
evenly, so it is written out). Each is written as a GGUF (`--dtype`,
default float16) by `pruner.checkpoints.gguf_file` and timed by `pruner.evaluation.llamacpp_timing`:
a fresh process per file and round, base and plans alternately, medians of `--repeats` rounds after a warm-up.
Targets: prefill T=2048 and decode gains >= 80% of the ideal for 50% group; KV cache bytes = the ideal
exactly; file size = the ideal saving to 1%.

The checks (unless --skip-checks): the 25% and 50% uniform plans as vanilla checkpoints reloaded by
transformers (logits to 1e-5, greedy tokens), converted by ONNX Runtime GenAI's builder (its greedy tokens
= PyTorch's), and as float32 GGUFs run by llama.cpp (its greedy tokens = PyTorch's); the global-budget plan
in llama.cpp too. Writes `--out` (default eval/results/bench/runtime_gguf.json).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from eval.common import RESULTS, random_model
from pruner.checkpoints import gguf_file, llamacpp, loading, saving
from pruner.core import environment
from pruner.evaluation import bench, llamacpp_timing
from pruner.evaluation.timing import BenchConfig
from pruner.pruning.selection import SelectionConfig

PLANS = [("50% group", SelectionConfig(target=0.5, budget="layer", gqa="group")),
         ("25% uniform", SelectionConfig(target=0.25, budget="layer", gqa="equal"))]
UNEVEN = (16, 8, 8, 0)  # heads removed per layer, in turn: 25% of the heads over every 4 layers


def uneven(base) -> dict[int, list[int]]:
    """25% of the heads, layers differing (`UNEVEN`), each layer's cut taken evenly from its KV groups."""
    from pruner.core import arch

    g = arch.geometry(base)
    plan = {}
    for layer in range(g.n_layers):
        per_group = UNEVEN[layer % len(UNEVEN)] // g.n_kv_heads
        plan[layer] = [k * g.group_size + i for k in range(g.n_kv_heads) for i in range(per_group)]
    return plan


def checks(base, pruned: dict, tok, work: Path) -> list[dict]:
    """Vanilla checkpoint (transformers), ONNX Runtime GenAI and llama.cpp, each against PyTorch's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from pruner.checkpoints import onnx

    out = []
    for label, model in pruned.items():
        rec = {"plan": label}
        gplan = gguf_file.plan(model, tok)
        path = work / "check.gguf"
        gguf_file.write(model, tok, path, "float32", gplan)
        rec["gguf_arch"] = gplan.arch
        rec["llama.cpp greedy = PyTorch"] = bool(llamacpp.check(path, model))
        path.unlink()
        if gplan.arch == "llama":
            hf, built = work / "hf", work / "onnx"
            saved = saving.save(model, tok, hf, True, "float32")  # raises unless logits and greedy tokens match
            rec.update(checkpoint=json.loads((hf / "config.json").read_text())["architectures"][0],
                       layout=saved.layout, max_diff=saved.max_diff, transformers_greedy=saved.generation)
            onnx.build(hf, built, "float32")
            reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
            rec["onnxruntime-genai greedy = PyTorch"] = bool(onnx.check(built, reference))
            del reference
            for folder in (hf, built):
                for f in sorted(folder.rglob("*"), reverse=True):
                    f.unlink() if f.is_file() else f.rmdir()
                folder.rmdir()
        print(rec, flush=True)
        out.append(rec)
    return out


def sizes(dtype: str, work: Path) -> dict:
    """GGUF file sizes of the base and of 50% of heads as whole KV groups against the ideal (parameters), and the
    KV cache bytes per token the files' metadata gives llama.cpp: shapes only, so the weights are left
    uninitialised (the file size does not depend on them)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from pruner.core import shapes
    from pruner.evaluation.ideal import saving
    from pruner.pruning import surgery

    with no_init_weights():
        base = AutoModelForCausalLM.from_config(shapes.config("llama-3.2-1b"), dtype=torch.float32).eval()
    tok = loading.load_tokenizer("llama-shakespeare")
    out = {}
    for label, heads in (("base", {}), ("50% group", {i: list(range(16)) for i in range(16)})):
        surgery.remove_heads(base, heads)
        path = work / "sizes.gguf"
        plan = gguf_file.plan(base, tok)
        gguf_file.write(base, tok, path, dtype, plan)
        kv = sum(2 * k * plan.head_dim * 2 for k in plan.kv_heads)  # what llama.cpp's f16 cache holds per token
        out[label] = {"bytes": path.stat().st_size, "params": sum(p.numel() for p in base.parameters()),
                      "kv_bytes_per_token": kv, "arch": plan.arch}
        path.unlink()
    b, p = out["base"], out["50% group"]
    out["file saving"] = saving(b["bytes"], p["bytes"])
    out["ideal (parameters)"] = saving(b["params"], p["params"])
    out["kv saving"] = saving(b["kv_bytes_per_token"], p["kv_bytes_per_token"])
    print(out, flush=True)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--sizes-only", action="store_true", help="file sizes and KV bytes only (no llama-cpp-python)")
    ap.add_argument("--out", default=str(RESULTS / "bench" / "runtime_gguf.json"))
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.sizes_only:
        with tempfile.TemporaryDirectory(prefix="bench-gguf-", dir=os.environ.get("BENCH_TMP")) as work:
            Path(args.out).write_text(json.dumps({"sizes": sizes(args.dtype, Path(work)),
                                                  "environment": environment.versions()}, indent=1) + "\n")
        return
    t0 = time.time()
    base = random_model("llama-3.2-1b", torch.float32)
    tok = loading.load_tokenizer("llama-shakespeare")  # ids are fed directly; the rest of the vocabulary is padding
    pruned = {label: bench.compact_copy(base, bench.weight_plan(base, sel, seed=0).heads) for label, sel in PLANS}
    pruned["25% uneven"] = bench.compact_copy(base, uneven(base))
    print(f"built in {time.time() - t0:.0f} s", flush=True)
    cfg = BenchConfig(tuple(int(x) for x in args.lengths.split(",")), ((1, args.prompt),), args.new_tokens,
                      args.repeats)
    records = {"checks": [], "bench": []}
    with tempfile.TemporaryDirectory(prefix="bench-gguf-", dir=os.environ.get("BENCH_TMP")) as work:
        work = Path(work)
        if not args.skip_checks:
            records["checks"] = checks(base, pruned, tok, work)
        files = {"base": work / "base.gguf"}
        gguf_file.write(base, tok, files["base"], args.dtype, gguf_file.plan(base, tok))
        for label, model in pruned.items():
            files[label] = work / f"{label.replace(' ', '-').replace('%', '')}.gguf"
            gguf_file.write(model, tok, files[label], args.dtype, gguf_file.plan(model, tok))
        load = [round(x, 2) for x in os.getloadavg()]
        t1 = time.time()
        runs = llamacpp_timing.measure(files, cfg, base.config.vocab_size, progress=True)
        for label, model in pruned.items():
            res = llamacpp_timing.compare(base, model, {"base": files["base"], "pruned": files[label]}, cfg,
                                          {"base": runs["base"], "pruned": runs[label]},
                                          itemsize=4 if args.dtype == "float32" else 2)
            res.conditions.update(dtype=args.dtype, load_average_before=load, seconds=round(time.time() - t1),
                                  load_average_after=[round(x, 2) for x in os.getloadavg()],
                                  gguf_bytes={"base": files["base"].stat().st_size,
                                              "pruned": files[label].stat().st_size})
            records["bench"].append({"model": "llama-3.2-1b", "plan": label, **res.to_dict()})
            print(f"\nllama-3.2-1b, {label}:\n{res.markdown()}", flush=True)
    Path(args.out).write_text(json.dumps({**records, "environment": environment.versions()}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
