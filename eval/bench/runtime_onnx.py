"""What pruning buys in ONNX Runtime GenAI (issue 25): base vs compact, both through the GenAI model builder.

    python -m eval.bench.runtime_onnx                           # the table of docs/what-pruning-buys.md
    python -m eval.bench.runtime_onnx --models llama-shakespeare --repeats 3 --out runs/bench/runtime_onnx.json

Models: the shipped llama-shakespeare, and random-weight models of the public Llama-3.2-1B and Qwen2.5-0.5B
configs (`eval.common.random_model`, float32: the builder's CPU precision). Plans: servable shapes
(the same heads per layer, a count the family's config accepts), from `random` scores through the usual
selection (which heads go does not change what removing them buys), keeping every KV head (`equal`) or
removing whole KV groups (`group`). Each model and plan is written as a vanilla checkpoint, converted by
`python -m onnxruntime_genai.models.builder -p fp32 -e cpu`, and timed by `pruner.evaluation.onnx_timing`:
a fresh process per model and round, base and pruned alternately, medians of `--repeats` rounds after a
warm-up. Target: where the ideal is >= 10%, >= 80% of it. Writes `--out` (default
eval/results/bench/runtime_onnx.json).
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
from pruner.checkpoints import loading, onnx, saving
from pruner.core import environment
from pruner.core.tables import markdown_table
from pruner.evaluation import bench, onnx_timing
from pruner.evaluation.timing import BenchConfig
from pruner.pruning.selection import SelectionConfig

PLANS = {  # name -> [(label, SelectionConfig)]: servable shapes only
    "llama-shakespeare": [("50% equal", SelectionConfig(target=0.5, budget="layer", gqa="equal")),
                          ("50% group", SelectionConfig(target=0.5, budget="layer", gqa="group"))],
    "llama-3.2-1b": [("50% equal", SelectionConfig(target=0.5, budget="layer", gqa="equal")),
                     ("50% group", SelectionConfig(target=0.5, budget="layer", gqa="group"))],
    "qwen2.5-0.5b": [("29% equal", SelectionConfig(target=4 * 24, budget="layer", gqa="equal")),
                     ("50% group", SelectionConfig(target=7 * 24, budget="layer", gqa="group"))],
}
CASES = {"llama-shakespeare": BenchConfig(lengths=(64, 255), decode=((1, 32), (8, 128)), new_tokens=64),
         "llama-3.2-1b": BenchConfig(lengths=(512, 2048), decode=((1, 32), (8, 512)), new_tokens=32),
         "qwen2.5-0.5b": BenchConfig(lengths=(512, 2048), decode=((1, 32), (8, 512)), new_tokens=32)}


def model_of(name: str):
    if name == "llama-shakespeare":
        return loading.load_model(name), loading.load_tokenizer(name)
    return random_model(name, torch.float32), loading.load_tokenizer("llama-shakespeare")  # ids are fed directly


def write(model, tokenizer, folder: Path, removed: bool) -> Path:
    """The model as a vanilla checkpoint (reload-checked), converted by the GenAI builder into `folder`."""
    with tempfile.TemporaryDirectory(prefix="bench-onnx-hf-", dir=folder.parent) as hf:
        saving.save(model, tokenizer, Path(hf), removed, "float32")
        onnx.build(Path(hf), folder, "float32")
    return folder


def bench_model(name: str, repeats: int, work: Path) -> list[dict]:
    t0 = time.time()
    base, tok = model_of(name)
    cfg = BenchConfig(CASES[name].lengths, CASES[name].decode, CASES[name].new_tokens, repeats)
    folders = {"base": write(base, tok, work / f"{name}-base", removed=False)}
    pruned = {}
    for label, sel in PLANS[name]:
        plan = bench.weight_plan(base, sel, seed=0)
        pruned[label] = bench.compact_copy(base, plan.heads)
        folders[label] = write(pruned[label], tok, work / f"{name}-{label.replace(' ', '-').replace('%', '')}", True)
    print(f"{name}: built and converted in {time.time() - t0:.0f} s", flush=True)
    load = os.getloadavg()
    t0 = time.time()
    runs = onnx_timing.measure(folders, cfg, base.config.vocab_size, progress=True)
    records = []
    for label, model in pruned.items():
        res = onnx_timing.compare(base, model, {"base": folders["base"], "pruned": folders[label]}, cfg,
                                  {"base": runs["base"], "pruned": runs[label]}, itemsize=4)
        res.conditions.update(load_average_before=[round(x, 2) for x in load], seconds=round(time.time() - t0),
                              load_average_after=[round(x, 2) for x in os.getloadavg()])
        records.append({"model": name, "plan": label, **res.to_dict()})
        print(f"\n{name}, {label}:\n{res.table()}", flush=True)
    return records


def summary(records: list[dict]) -> str:
    rows, missed, met = [], [], 0
    for r in records:
        for f in r["figures"]:
            cell = f"{100 * f['saving']:+.1f}% / {100 * f['ideal']:.1f}%"
            rows.append([r["model"], r["plan"], f"{f['name']} ({f['unit']})", f"{f['base']:.4g}", f"{f['pruned']:.4g}",
                         cell, "—" if f["of_ideal"] is None else f"{f['of_ideal']:.2f}"])
            if f["ideal"] >= 0.10:
                if f["of_ideal"] is not None and f["of_ideal"] >= 0.8:
                    met += 1
                else:
                    missed.append(f"{r['model']} {r['plan']} {f['name']}: {100 * f['saving']:+.1f}% of an ideal "
                                  f"{100 * f['ideal']:.1f}% ({f['of_ideal']:.2f} of it)")
    table = markdown_table(["model", "plan", "figure", "base", "pruned", "saving / ideal", "realised / ideal"], rows)
    return table + f"\n\nTarget (ideal >= 10%: >= 80% of it): {met} met, {len(missed)} missed" + "".join(
        f"\n- missed: {m}" for m in missed)


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(PLANS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "bench" / "runtime_onnx.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as work:
        for name in args.models.split(","):
            records += bench_model(name, args.repeats, Path(work))
    Path(args.out).write_text(json.dumps({"records": records, "environment": environment.versions()}, indent=1) + "\n")
    print("\n" + summary(records))


if __name__ == "__main__":
    main()
