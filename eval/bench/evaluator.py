"""Evaluator and scorer benchmark: perplexity vs a plain forward, gradient vs attention-based scoring.

    python -m eval evaluator             # the table of docs/scaling.md (~6 min on 2 cores): the command it runs
    python -m eval.bench.evaluator --models gpt2-shakespeare --repeats 1     # one model

On each model, the same windows / samples, `--threads` torch threads, repeats
interleaved round-robin (a shared machine's load falls on every case alike),
median wall time after a warm-up round:
  perplexity   `pruner.evaluation.perplexity.window_scores` over the evaluation windows (forward,
               float32 log-softmax, token-weighted NLL), vs
  forward      plain forward passes over the same batches (logits, nothing else):
               tokens/s of both, and their ratio;
  attention    what every attention-based scorer reads: `calibrate(gradient=False)`,
               one capture pass with output moments and pair metrics + weight grams, vs
  gradient     `gradient_importance` (Michel et al.): one forward + backward per window,
               on the same calibration windows.
Models: the shipped reference checkpoints with their recipes' evaluation and
calibration settings (64 windows of 128 tokens), and the random GPT-2-small shape
(8 random-token windows of 512).
Writes `--out` (default runs/bench/evaluator.json) and the plot beside it (.png), prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from pruner.core import environment
from pruner.core.tables import markdown_table

MODELS = ("gpt2-shakespeare", "llama-shakespeare", "minilm-causal", "gpt2-small-random")


def setup(name: str, n_windows: int, n_calib: int):
    """(model, evaluation windows, calibration batch)."""
    import torch

    from pruner.checkpoints import loading
    from pruner.core import data, shapes
    from pruner.evaluation.perplexity import EvalWindows, sliding_windows

    if name == "gpt2-small-random":
        import transformers as tf

        torch.manual_seed(0)
        model = tf.GPT2LMHeadModel(shapes.config("gpt2-small")).eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (8, 512), generator=g)  # 8 windows of 512
        ones = torch.ones_like(ids)
        return model, EvalWindows(ids, ones, ids.clone()), data.TokenBatch(ids, ones)
    model, tok = loading.load_model(name), loading.load_tokenizer(name)
    ev = data.load_texts(data.TextSource("shakespeare:evaluation"))
    cal = data.load_texts(data.TextSource("shakespeare:calibration"))
    return (model, sliding_windows(tok, ev, 128, max_windows=n_windows),
            data.token_windows(tok, cal, 128, num_samples=n_calib, seed=0))


def bench_model(name: str, args) -> dict:
    import torch

    from pruner.attention.capture import CaptureConfig
    from pruner.attention.sinks import SinkSpec
    from pruner.core.runtime import forward
    from pruner.evaluation.perplexity import window_scores
    from pruner.pruning.calibrate import CalibrationOptions, calibrate, gradient_importance

    model, windows, batch = setup(name, args.windows, args.calibration)
    bs = args.batch_size

    @torch.no_grad()
    def plain():
        for i in range(0, len(windows), bs):
            forward(model, windows.input_ids[i:i + bs], windows.attention_mask[i:i + bs])

    cases = {
        "forward": plain,
        "perplexity": lambda: window_scores(model, windows, bs),
        "attention": lambda: calibrate(model, batch, SinkSpec("first"),
                                       config=CaptureConfig(metrics=("cosine", "js"), outputs=True),
                                       options=CalibrationOptions(batch_size=bs)),
        "gradient": lambda: gradient_importance(model, batch),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.repeats + 1):  # round 0 is the warm-up
        for k, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = int(windows.attention_mask.sum())
    return {"model": name, "eval_windows": len(windows), "eval_tokens": tokens, "calib_windows": len(batch),
            "calib_tokens": int(batch.attention_mask.sum()), "times_s": times, "median_s": med,
            "forward_tok_s": tokens / med["forward"], "perplexity_tok_s": tokens / med["perplexity"],
            "perplexity_over_forward": med["perplexity"] / med["forward"],
            "gradient_over_attention": med["gradient"] / med["attention"]}


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        T = r["eval_tokens"] // r["eval_windows"]
        rows.append([r["model"], f"{r['eval_windows']} x {T}", f"{r['forward_tok_s']:.0f}", f"{r['perplexity_tok_s']:.0f}",
                     f"{r['perplexity_over_forward']:.2f}", r["calib_windows"], f"{r['median_s']['attention']:.2f}",
                     f"{r['median_s']['gradient']:.2f}", f"{r['gradient_over_attention']:.2f}"])
    return markdown_table(["model", "eval windows x T", "forward tok/s", "perplexity tok/s", "perplexity/forward time",
                           "calib windows", "attention scoring s", "gradient scoring s", "gradient/attention"], rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["model"] for r in results]
    x = range(len(names))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.bar([i - 0.2 for i in x], [r["forward_tok_s"] for r in results], 0.4, label="plain forward")
    a.bar([i + 0.2 for i in x], [r["perplexity_tok_s"] for r in results], 0.4, label="perplexity")
    a.set(ylabel="tokens / s", title="evaluator throughput", xticks=list(x))
    a.set_xticklabels(names, rotation=15, fontsize=7)
    b.bar([i - 0.2 for i in x], [r["median_s"]["attention"] for r in results], 0.4, label="attention (capture)")
    b.bar([i + 0.2 for i in x], [r["median_s"]["gradient"] for r in results], 0.4, label="gradient (Michel)")
    b.set(ylabel="seconds", title="scoring inputs on the calibration windows", xticks=list(x), yscale="log")
    b.set_xticklabels(names, rotation=15, fontsize=7)
    for ax in (a, b):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--windows", type=int, default=64, help="evaluation windows (random model: 8 of 512)")
    ap.add_argument("--calibration", type=int, default=64, help="calibration windows (random model: 8 of 512)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="runs/bench/evaluator.json", help="the JSON written (the plot beside it, .png)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    results = []
    for name in args.models.split(","):
        t0 = time.time()
        results.append(bench_model(name, args))
        print(f"{name}: done in {time.time() - t0:.0f} s", flush=True)
    meta = {**environment.versions(), **environment.machine(), "threads": args.threads, "repeats": args.repeats,
            "batch_size": args.batch_size, "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "time_method": f"median of {args.repeats} rounds after a warm-up round, cases interleaved"}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print("\n" + table(results) + "\n")
    print(f"load average 1/5/15 min: start {load_start}, end {meta['loadavg_end']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
