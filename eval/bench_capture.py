"""Capture benchmark: a plain SDPA forward vs pruner's streaming capture vs eager attention maps.

    PYTHONPATH=. python eval/bench_capture.py                 # the README table (~15 min on 2 cores)
    PYTHONPATH=. python eval/bench_capture.py --long 8192     # also (a) and (b) at T=8192
    PYTHONPATH=. python eval/bench_capture.py --models gpt2-small-random --lengths 256 --repeats 1  # smoke

On the same model and the same tokens (batch 1), each case is one of
  (a) plain       one SDPA forward pass (logits included, as every case computes them);
  (b) capture     pruner's streaming capture with its default statistics: sink mass,
                  entropies (full, content, attribution terms), dormancy, and the
                  within-layer head x head cosine and JS matrices under both conventions;
  (b') capture_se the same capture restricted to sink mass + entropies (metrics=()),
                  the like-for-like counterpart of (c);
       capture_cos sink mass + entropies + the cosine matrices only: what the pruning
                  scorers read (JS is for `pruner analyze`); not in the default --modes;
  (c) eager       the naive path: eager attention with `output_attentions=True`, then sink
                  mass and entropy per head from the stored layers x heads x T x T maps.

Method. Every case runs in a fresh subprocess (this script with `--case`), so no
allocator state leaks between cases. Memory: after the model is loaded and has run
an 8-token warm-up, the kernel's peak-RSS counter is reset (`/proc/self/clear_refs`
= 5) and the case runs once; its cost is VmHWM minus the VmRSS just before it (peak
resident growth: what the case needs on top of the loaded model, torch allocations
and Python objects alike). glibc's mmap threshold is fixed at 128 KiB in these
processes, so freed tensors leave resident memory at once and the peak follows live
memory (with the default dynamic threshold, freed heap kept by one case made the
same case vary by +-300 MiB). Time: one more process per model and length runs every mode in
turn, a warm-up round and then `--repeats` rounds (interleaved, so a shared
machine's load falls on every mode alike); the median per mode, `--threads` threads.

Models: `gpt2-small-random` (12 layers x 12 heads x 768, randomly initialised, 8192
positions) and the shipped reference checkpoints, each at the lengths its position
table allows (RoPE models: all). Writes `<out>/bench_capture.json` and `.png`, and
prints the table and the issue's targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("plain", "capture", "capture_se", "eager")
EXTRA_MODES = ("capture_cos",)
RANDOM = "gpt2-small-random"
DEFAULT_MODELS = (RANDOM, "llama-shakespeare", "minilm-causal", "gpt2-shakespeare")


# --------------------------------------------------------------------------- one case (subprocess)

def _proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(val.split()[0]) / 1024
    return out


def load(name: str):
    """(model, input ids (1, T_max) source) for a benchmark model name."""
    import torch

    if name == RANDOM:
        import transformers as tf

        torch.manual_seed(0)
        cfg = tf.GPT2Config(n_layer=12, n_head=12, n_embd=768, n_positions=8192)
        return tf.GPT2LMHeadModel(cfg).eval(), None
    from pruner import models

    return models.load_model(name), models.load_tokenizer(name)


def max_positions(model) -> int | None:
    """Longest input the position table allows; None for rotary models (any length runs)."""
    c = model.config
    if getattr(c, "rope_parameters", None) or getattr(c, "rope_theta", None):
        return None
    return getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None)


def tokens(tokenizer, vocab: int, T: int):
    """The first T tokens of the shipped evaluation text (BOS first), or seeded random ids."""
    import torch

    if tokenizer is None:
        return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(0))
    from pruner import data

    batch = data.token_windows(tokenizer, data.load_texts(data.TextSource("shakespeare:evaluation")), T,
                               num_samples=1, seed=0)
    return batch.input_ids[:1]


def case_fn(mode: str, model, ids):
    """A zero-argument callable running one case."""
    import torch

    from pruner.capture import CaptureConfig, capture_stats
    from pruner.data import TokenBatch
    from pruner.models import forward
    from pruner.sinks import SinkSpec

    mask = torch.ones_like(ids)
    batch = TokenBatch(ids, mask)
    spec = SinkSpec("first")
    if mode == "plain":
        return lambda: torch.no_grad()(forward)(model, ids, mask)
    if mode == "capture":
        return lambda: capture_stats(model, batch, spec, config=CaptureConfig())
    if mode == "capture_se":
        return lambda: capture_stats(model, batch, spec, config=CaptureConfig(metrics=()))
    if mode == "capture_cos":
        return lambda: capture_stats(model, batch, spec, config=CaptureConfig(metrics=("cosine",)))
    if mode == "eager":
        model.set_attn_implementation("eager")

        @torch.no_grad()
        def naive():
            maps = forward(model, ids, mask, output_attentions=True).attentions  # layer x (B, H, T, T)
            rows = slice(1, None)  # every query but the sink itself
            sink = torch.stack([a[:, :, rows, 0].mean(dim=(0, 2)) for a in maps])  # (layer, head)
            ent = torch.stack([-torch.xlogy(a[:, :, rows], a[:, :, rows]).sum(-1).mean(dim=(0, 2))
                               for a in maps])
            return sink, ent
        return naive
    raise ValueError(mode)


def memory_case(name: str, mode: str, T: int, threads: int) -> dict:
    """Peak resident growth (MiB) of one run of one case, in this (fresh) process."""
    import torch

    torch.set_num_threads(threads)
    model, tok = load(name)
    ids = tokens(tok, model.config.vocab_size, T)
    fn = case_fn(mode, model, ids)
    case_fn(mode, model, ids[:, :8])()  # warm-up: allocator, lazy imports, kernels
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter
    before = _proc_status()["VmRSS"]
    fn()
    return {"extra_mib": _proc_status()["VmHWM"] - before}


def time_cases(name: str, modes: list[str], T: int, threads: int, repeats: int) -> dict:
    """Wall time of every mode on one model and length, repeats interleaved round-robin.

    Interleaving makes the load of a shared machine fall on every mode alike.
    """
    import torch

    torch.set_num_threads(threads)
    model, tok = load(name)
    ids = tokens(tok, model.config.vocab_size, T)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(repeats + 1):  # round 0 is the warm-up
        for mode in modes:
            fn = case_fn(mode, model, ids)
            t0 = time.perf_counter()
            fn()
            if r:
                times[mode].append(time.perf_counter() - t0)
            model.set_attn_implementation("sdpa")
    return times


# --------------------------------------------------------------------------- driver

# Memory cases: glibc serves every allocation >= 128 KiB by mmap and unmaps it on free, so
# resident memory follows live tensors (no freed-but-kept heap inflating one case's peak).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def spawn(args: list[str], env_extra: dict | None = None):
    """Run this script in a fresh process with `args`; its last stdout line is JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", **(env_extra or {})}
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(name: str, T: int, modes: list[str], args) -> list[dict]:
    """Every mode on one model and length: memory one process per mode, time one shared process."""
    common = ["--threads", str(args.threads)]
    repeats = args.repeats if T <= 2048 else 1
    times = spawn(["--time", name, str(T), "--modes", ",".join(modes), "--repeats", str(repeats), *common])
    out = []
    for mode in modes:
        mem = spawn(["--memory", name, mode, str(T), *common], MALLOC_ENV)
        r = {"model": name, "mode": mode, "T": T}
        if "error" in mem or "error" in times:
            r["error"] = mem.get("error") or times.get("error")
        else:
            r.update(extra_mib=mem["extra_mib"], times_s=times[mode], median_s=statistics.median(times[mode]))
        out.append(r)
    return out


def lengths_for(name: str, lengths: list[int]) -> list[int]:
    if name == RANDOM:
        return lengths
    model, _ = load(name)
    limit = max_positions(model)
    fits = [T for T in lengths if limit is None or T <= limit]
    return fits or [limit]


def table(results: list[dict]) -> str:
    """Ratios to the plain forward: time, and peak memory growth on top of the plain pass."""
    by = {(r["model"], r["T"], r["mode"]): r for r in results if "error" not in r}
    head = ("| model | T | plain s | capture s | capture_se s | eager s | capture/plain | capture_se/plain "
            "| eager/plain | plain MiB | capture +MiB | capture_se +MiB | eager +MiB | capture/eager mem |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (model, T) in dict.fromkeys((r["model"], r["T"]) for r in results):
        g = lambda mode, k: by.get((model, T, mode), {}).get(k)  # noqa: E731
        plain_s, plain_m = g("plain", "median_s"), g("plain", "extra_mib")
        fmt = lambda x, f="{:.2f}": "—" if x is None else f.format(x)  # noqa: E731
        ratio = lambda mode: None if g(mode, "median_s") is None else g(mode, "median_s") / plain_s  # noqa: E731
        over = lambda mode: None if g(mode, "extra_mib") is None else g(mode, "extra_mib") - plain_m  # noqa: E731
        mem_ratio = None if over("eager") in (None, 0) or over("capture") is None else over("capture") / over("eager")
        lines.append(f"| {model} | {T} | {fmt(plain_s)} | {fmt(g('capture', 'median_s'))} | "
                     f"{fmt(g('capture_se', 'median_s'))} | {fmt(g('eager', 'median_s'))} | {fmt(ratio('capture'))} | "
                     f"{fmt(ratio('capture_se'))} | {fmt(ratio('eager'))} | {fmt(plain_m, '{:.0f}')} | "
                     f"{fmt(over('capture'), '{:+.0f}')} | {fmt(over('capture_se'), '{:+.0f}')} | "
                     f"{fmt(over('eager'), '{:+.0f}')} | {fmt(mem_ratio, '{:.3f}')} |")
    return "\n".join(lines)


def targets(results: list[dict]) -> list[str]:
    """The issue's targets on the random GPT-2-small model."""
    by = {(r["T"], r["mode"]): r for r in results if r["model"] == RANDOM and "error" not in r}
    out = []
    for T in (1024, 2048):
        if (T, "plain") not in by:
            continue
        for mode in ("capture", "capture_cos", "capture_se"):
            if (T, mode) in by:
                r = by[T, mode]["median_s"] / by[T, "plain"]["median_s"]
                out.append(f"T={T} {mode}/plain time {r:.2f} (target <= 1.5): {'met' if r <= 1.5 else 'MISSED'}")
    if (2048, "eager") in by:
        plain = by[2048, "plain"]["extra_mib"]
        eager = by[2048, "eager"]["extra_mib"] - plain
        for mode in ("capture", "capture_cos", "capture_se"):
            if (2048, mode) in by:
                extra = by[2048, mode]["extra_mib"] - plain
                out.append(f"T=2048 {mode} extra memory {extra:.0f} MiB vs eager {eager:.0f} MiB = "
                           f"{extra / eager:.3f} (target <= 0.1): {'met' if extra <= eager / 10 else 'MISSED'}")
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(len(names), 2, figsize=(10, 3.2 * len(names)), squeeze=False)
    for row, name in zip(axes, names):
        for mode in MODES + EXTRA_MODES:
            rs = sorted((r for r in results if r["model"] == name and r["mode"] == mode and "error" not in r),
                        key=lambda r: r["T"])
            if not rs:
                continue
            Ts = [r["T"] for r in rs]
            row[0].plot(Ts, [r["median_s"] for r in rs], "o-", label=mode)
            row[1].plot(Ts, [r["extra_mib"] for r in rs], "o-", label=mode)
        for ax, what in zip(row, ("wall time (s)", "peak RSS growth (MiB)")):
            ax.set(xscale="log", yscale="log", xlabel="context length T", ylabel=what, title=name)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", nargs=3, metavar=("MODEL", "MODE", "T"), help=argparse.SUPPRESS)
    ap.add_argument("--time", nargs=2, metavar=("MODEL", "T"), help=argparse.SUPPRESS)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--long", type=int, default=None,
                    help="also run plain and capture on the random model at this length (e.g. 8192); "
                         "eager is skipped there: its maps alone need layers x heads x T^2 x 4 bytes")
    ap.add_argument("--long-modes", default="plain,capture_se",
                    help="modes run at --long (default capture's pair metrics cost O(heads^2 T^2): minutes there)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if args.memory:
        name, mode, T = args.memory
        print(json.dumps(memory_case(name, mode, int(T), args.threads)))
        return 0
    if args.time:
        print(json.dumps(time_cases(args.time[0], modes, int(args.time[1]), args.threads, args.repeats)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    jobs = [(name, T, modes) for name in args.models.split(",") for T in lengths_for(name, lengths)]
    if args.long and RANDOM in args.models.split(","):
        jobs.append((RANDOM, args.long, [m for m in args.long_modes.split(",") if m != "eager"]))
    load_start = os.getloadavg()
    results = []
    for i, (name, T, ms) in enumerate(jobs):
        t0 = time.time()
        rs = bench(name, T, ms, args)
        results += rs
        print(f"[{i + 1}/{len(jobs)}] {name} T={T}: " + ", ".join(
            f"{r['mode']} " + (r["error"] if "error" in r else f"{r['median_s']:.2f} s +{r['extra_mib']:.0f} MiB")
            for r in rs) + f"  ({time.time() - t0:.0f} s)", flush=True)
    import torch

    meta = {"threads": args.threads, "repeats": args.repeats, "cpus": os.cpu_count(), "torch": torch.__version__,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "memory_method": "peak RSS growth (VmHWM after clear_refs=5, minus VmRSS before), fresh process per case, "
                             "glibc mmap threshold fixed at 128 KiB",
            "time_method": f"median of {args.repeats} runs (1 at T > 2048) after a warm-up round, "
                           "modes interleaved round-robin in one process"}
    (out / "bench_capture.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    plot(results, out / "bench_capture.png")
    text = table(results)
    print("\n" + text + "\n")
    for line in targets(results):
        print(line)
    print(f"load average 1/5/15 min: start {load_start}, end {meta['loadavg_end']}")
    print(f"wrote {out}/bench_capture.json and bench_capture.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
