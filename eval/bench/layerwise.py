"""Layer-by-layer calibration at real sizes on this machine (issue 24): random weights from public configs,
written as sharded safetensors without ever holding the model in memory, calibrated from disk one block
at a time.

    python -m eval.bench.layerwise 8b --windows 4 --length 256          # Llama-3-8B shape: peak RSS and time
    python -m eval.bench.layerwise 70b-width --layers 2 --windows 2 --length 256  # per layer vs the model
    python -m eval.bench.layerwise 1b --procs 2 --windows 8 --length 256 --threads 1   # 2 processes vs 1

Models: `8b` Meta-Llama-3-8B, `70b-width` Meta-Llama-3-70B (cut with `--layers`), `1b` Llama-3.2-1B, their
public configs (`pruner.core.shapes`).

`--procs 2` runs the calibration twice, in one process and under `torchrun --nproc_per_node 2` (gloo), each
process taking every second window: peak RSS per process, the plans of two scorers (identical), and the
largest difference of every statistic (float64 summation order, and float32 products of other batches).

Each case runs in a fresh process: `calibrate` reads the checkpoint lazily (`pruner.checkpoints.lazy`), and
the same blocks are also run once without the capture (the plain layer-by-layer forward of the same windows,
SDPA), so the calibration's cost is the ratio of the two. Memory is the process's peak resident set (VmHWM)
against the model's size on disk and against the memory model (`pruner.runs.calibration_memory`, sequential, CPU:
device and host one memory). `--ridge` fixed (default 0.1) keeps the fold moments of ridge auto out, as the
memory model says they would not fit at 70B. Writes eval/results/bench/layerwise/<case>.json
(`8b`, `8b-2` with `--layers 2`, `1b-2proc` with `--procs 2`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from eval.common import MALLOC_ENV, RESULTS, child_env, gib
from pruner.core.proc_status import status

SHAPES = {"8b": "llama-3-8b", "70b-width": "llama-3-70b", "1b": "llama-3.2-1b"}  # pruner.core.shapes


def write_checkpoint(name: str, layers: int | None, folder: Path, shard_bytes: int | None = None) -> Path:
    """config.json + one safetensors shard per block (and one for the rest), seeded normal(0, 0.02) bfloat16
    weights, norms 1: never more than one block in memory. With `shard_bytes`, shards as `save_pretrained` cuts
    them instead: tensors in the model's order, a new shard once one holds `shard_bytes` (HF's usual 2 GB:
    several blocks to a shard, a block across two)."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from pruner.core import shapes

    if (folder / "model.safetensors.index.json").exists():
        return folder
    cut = {"num_hidden_layers": layers} if layers else {}
    config = shapes.config(SHAPES[name], torch_dtype="bfloat16", architectures=["LlamaForCausalLM"],  # a causal LM:
                           **cut)                                                               # the LM head is used
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    groups: dict[str, dict[str, tuple]] = {}
    for key, p in meta.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        part = key.split(".")[2] if key.startswith("model.layers.") else "rest"
        if shard_bytes is not None:  # the running shard, by bytes
            full = groups and sum(2 * torch.Size(s).numel() for s in list(groups.values())[-1].values()) >= shard_bytes
            part = str(len(groups) + (1 if full or not groups else 0))
        groups.setdefault(part, {})[key] = tuple(p.shape)
    if shard_bytes is not None:
        groups = {f"{int(k):05d}-of-{len(groups):05d}": v for k, v in groups.items()}
    weight_map = {}
    for part, tensors in groups.items():
        shard = f"model-{part}.safetensors"
        data = {}
        for key, shape in tensors.items():
            t = torch.empty(shape, dtype=torch.bfloat16)
            t.normal_(0, 0.02, generator=g) if len(shape) >= 2 else t.fill_(1.0)
            data[key] = t
            weight_map[key] = shard
        save_file(data, str(folder / shard), metadata={"format": "pt"})
        del data
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    return folder


def _peak() -> int:
    return status().get("VmHWM", 0)


def _materialised(model) -> int:
    """Bytes of the weights that are in memory (the blocks stay on the meta device until onloaded)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")


def case(folder: Path, windows: int, length: int, ridge: float, threads: int) -> dict:
    """In this process: plain layer-by-layer forward, then the layer-by-layer calibration, from disk."""
    from pruner.attention.capture import CaptureConfig
    from pruner.attention.sinks import SinkSpec
    from pruner.checkpoints.lazy import lazy_model
    from pruner.core import arch
    from pruner.core.data import TokenBatch
    from pruner.core.layerwise import PassOptions, first_block_calls, run_blocks
    from pruner.pruning.layerwise import LayerwiseScoring, calibrate_layerwise
    from pruner.pruning.per_layer import CurveRequest
    from pruner.runs import calibration_memory
    from pruner.runs.resources import Sizes

    torch.set_num_threads(threads)
    baseline = _peak()  # the interpreter with torch and transformers imported: not pruner's to predict
    t0 = time.perf_counter()
    lazy = lazy_model(folder, "bfloat16")
    load_s = time.perf_counter() - t0
    ids = torch.randint(3, lazy.model.config.vocab_size, (windows, length), generator=torch.Generator().manual_seed(0))
    batch = TokenBatch(ids, torch.ones_like(ids))
    g = arch.geometry(lazy.model)
    t0 = time.perf_counter()
    calls = first_block_calls(lazy.model, [(b.input_ids, b.attention_mask) for b in batch.batches(4)], "cpu")
    run_blocks(lazy, calls, g.n_layers, "cpu")
    plain_s = time.perf_counter() - t0
    peak_plain = _peak()
    t0 = time.perf_counter()
    cfg = CaptureConfig(metrics=("cosine",), outputs=True)
    calibrate_layerwise(lazy.model, batch, SinkSpec("first"), None, cfg, lazy,
                        LayerwiseScoring(CurveRequest(()), ridge=ridge), PassOptions(batch_size=4))
    cal_s = time.perf_counter() - t0
    sizes = Sizes(batch_size=min(4, windows), length=length, pair_metrics=1, outputs=True)
    plan = calibration_memory.memory_plan(lazy.model, sizes, windows, "sequential", "cpu")
    disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"layers": g.n_layers, "windows": windows, "length": length, "threads": threads,
            "model_bytes_on_disk": disk, "resident_weights": _materialised(lazy.model), "load_s": load_s,
            "plain_s": plain_s, "calibrate_s": cal_s, "calibrate_over_plain": cal_s / plain_s,
            "peak_rss_plain": peak_plain, "peak_rss": _peak(), "baseline_rss": baseline, "predicted_peak": plan.total,
            "predicted_parts": {**{f"device/{k}": v for k, v in plan.device.parts.items()},
                                **{f"host/{k}": v for k, v in plan.host.parts.items()}}}


def procs_case(folder: Path, windows: int, length: int, ridge: float, threads: int, dump: Path) -> dict | None:
    """In each process of a torchrun group (or alone): the layer-by-layer calibration from disk on this
    process's share of the windows (each layer's sums reduced to rank 0 as it finishes: the others keep none);
    rank 0 selects, saves the statistics to `dump` and returns every rank's peak RSS and the plans."""
    from dataclasses import asdict

    from pruner.attention.capture import CaptureConfig
    from pruner.attention.sinks import SinkSpec
    from pruner.checkpoints.lazy import lazy_model
    from pruner.core import arch, distributed
    from pruner.core.data import TokenBatch
    from pruner.core.layerwise import PassOptions
    from pruner.pruning.layerwise import LayerwiseScoring, calibrate_layerwise
    from pruner.pruning.per_layer import CurveRequest
    from pruner.pruning.scoring import get_scorer
    from pruner.pruning.selection import SelectionConfig, curve_key, select

    torch.set_num_threads(threads)
    lazy = lazy_model(folder, "bfloat16")
    ids = torch.randint(3, lazy.model.config.vocab_size, (windows, length), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    g = arch.geometry(lazy.model)
    keys = tuple(curve_key(get_scorer(n), g, SelectionConfig(target=0.25)) for n in ("sink-aware", "refit-energy"))
    inputs = calibrate_layerwise(lazy.model, TokenBatch(ids, torch.ones_like(ids)), SinkSpec("first"), None,
                                 CaptureConfig(metrics=("cosine",), outputs=True), lazy,
                                 LayerwiseScoring(CurveRequest(keys), ridge=ridge), PassOptions(batch_size=4))
    cal_s = time.perf_counter() - t0
    plans = None if inputs is None else {  # several processes: rank 0 alone keeps the sums and selects
        name: select(get_scorer(name), inputs, g, SelectionConfig(target=0.25)).heads
        for name in ("sink-aware", "refit-energy")}
    peaks = distributed.all_objects(_peak())
    if not distributed.is_main():
        return None
    stats = {k: v for k, v in asdict(inputs.stats).items() if isinstance(v, torch.Tensor)}
    stats.update({f"outputs/{i}/{k}": v for i, m in enumerate(inputs.stats.outputs)
                  for k, v in asdict(m).items() if isinstance(v, torch.Tensor)})
    torch.save(stats, dump)
    return {"processes": distributed.world_size(), "layers": g.n_layers, "windows": windows, "length": length,
            "threads": threads, "calibrate_s": cal_s, "peak_rss_per_process": peaks,
            "plans": {k: {str(layer): v for layer, v in sorted(p.items())} for k, p in plans.items()}}


def write(name: str, r: dict) -> None:
    out = RESULTS / "bench" / "layerwise" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=1) + "\n")
    print(f"wrote {out}")


def compare_processes(args, folder: Path, env: dict) -> None:
    """One process, then `procs` under torchrun: peak RSS per process, plans and statistics."""
    runs = {}
    for procs in (1, args.procs):
        dump = Path(args.work) / f"stats-{procs}.pt"
        tail = ["-m", __spec__.name, args.model, "--procs-case", str(folder), "--dump", str(dump), "--windows",
                str(args.windows), "--length", str(args.length), "--ridge", str(args.ridge), "--threads",
                str(args.threads)]
        head = [sys.executable] if procs == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
        done = subprocess.run(head + tail, capture_output=True, text=True, env=env)
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        runs[procs] = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])
        runs[procs]["stats"] = torch.load(dump)
        dump.unlink()
    one, many = runs[1], runs[args.procs]
    worst = max(((k, float((many["stats"][k] - v).abs().max() / v.abs().max().clamp_min(1e-300)))
                 for k, v in one["stats"].items() if v.numel()), key=lambda kv: kv[1])  # uu/ww: empty unless asked
    r = {k: v for k, v in one.items() if k not in ("stats", "peak_rss_per_process", "calibrate_s", "processes",
                                                   "plans")}
    r.update({"model_bytes_on_disk": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
              "one": {k: one[k] for k in ("calibrate_s", "peak_rss_per_process")},
              "many": {k: many[k] for k in ("processes", "calibrate_s", "peak_rss_per_process")},
              "plans_identical": one["plans"] == many["plans"], "plans": one["plans"],
              "largest_relative_difference": {"statistic": worst[0], "value": worst[1]}})
    print(f"{args.model} ({r['layers']} layers, {gib(r['model_bytes_on_disk']):.2f} GiB), {args.windows} windows x "
          f"{args.length} tokens, {args.threads} thread(s) per process")
    print(f"  1 process: calibration {one['calibrate_s']:.1f} s, "
          f"peak RSS {gib(one['peak_rss_per_process'][0]):.2f} GiB")
    print(f"  {args.procs} processes: calibration {many['calibrate_s']:.1f} s, peak RSS per process "
          + ", ".join(f"{gib(p):.2f}" for p in many["peak_rss_per_process"]) + " GiB "
          f"(largest / one process: {max(many['peak_rss_per_process']) / one['peak_rss_per_process'][0]:.2f})")
    print(f"  plans (sink-aware, refit-energy at 25%) identical: {r['plans_identical']}; largest relative "
          f"difference of a statistic: {worst[1]:.1e} ({worst[0]})")
    write(f"{args.model}-{args.procs}proc", r)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many blocks")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--ridge", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/pruner-bench-layerwise")
    ap.add_argument("--procs", type=int, default=1, help="also calibrate under torchrun with this many processes")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--procs-case", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.procs_case:  # a child of --procs: one process of the group
        r = procs_case(Path(args.procs_case), args.windows, args.length, args.ridge, args.threads, Path(args.dump))
        if r is not None:
            print(json.dumps(r))
        return
    if args.case:  # the child: one measurement, JSON on stdout
        print(json.dumps(case(Path(args.case), args.windows, args.length, args.ridge, args.threads)))
        return
    folder = Path(args.work) / f"{args.model}-{args.layers or 'all'}"
    t0 = time.time()
    write_checkpoint(args.model, args.layers, folder)
    print(f"checkpoint {folder}: {sum(f.stat().st_size for f in folder.glob('*.safetensors')) / 2**30:.1f} GiB "
          f"({time.time() - t0:.0f} s)", flush=True)
    env = child_env(OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_=MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"])
    if args.procs > 1:
        compare_processes(args, folder, env)
        return
    cmd = [sys.executable, "-m", __spec__.name, args.model, "--case", str(folder), "--windows", str(args.windows),
           "--length", str(args.length), "--ridge", str(args.ridge), "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    r = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{args.model} ({r['layers']} layers), {r['windows']} windows x {r['length']} tokens, {r['threads']} threads")
    print(f"  model on disk {gib(r['model_bytes_on_disk']):.2f} GiB; outside the blocks (memory-mapped, resident as "
          f"read) {gib(r['resident_weights']):.2f} GiB")
    print(f"  plain layer-by-layer forward {r['plain_s']:.1f} s, calibration {r['calibrate_s']:.1f} s "
          f"({r['calibrate_over_plain']:.2f}x)")
    above = r["peak_rss"] - r["baseline_rss"]
    print(f"  peak RSS {gib(r['peak_rss']):.2f} GiB ({r['peak_rss'] / r['model_bytes_on_disk']:.0%} of the model), "
          f"{gib(above):.2f} GiB above the interpreter with torch imported ({gib(r['baseline_rss']):.2f} GiB); "
          f"memory model {gib(r['predicted_peak']):.2f} GiB (measured above the interpreter / predicted "
          f"{above / r['predicted_peak']:.2f})")
    for part, n in r["predicted_parts"].items():
        print(f"    predicted {part}: {gib(n):.2f} GiB")
    write(f"{args.model}{'-' + str(args.layers) if args.layers else ''}", r)


if __name__ == "__main__":
    main()
