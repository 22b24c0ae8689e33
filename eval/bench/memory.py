"""How honest is the memory estimate? `resources.calibration_estimate` vs the measured peak of calibration.

    python -m eval.bench.memory                  # the docs table (docs/long-runs.md) (~5 min on 2 cores)
    python -m eval.bench.memory --cases gpt2-shakespeare:8:128:0 --out runs/bench/memory.json   # one case

Each case (model, batch size, window length, gradient scorer or not) runs in a fresh
subprocess: the model is loaded, a batch of random token windows built, an 8-token
warm-up run, then the kernel's peak-RSS counter is reset (`/proc/self/clear_refs` = 5)
and `calibrate` runs once, as `pruner prune` runs it (cosine pairs, output moments,
chunk 128; with the gradient pass when asked). Measured: VmHWM minus the VmRSS just
before (what calibration needs on top of the loaded model). Estimated: the estimate's
total minus the model's own bytes, which is what `check_memory` compares with the free
memory. glibc's mmap threshold is fixed at 128 KiB so freed tensors leave resident
memory at once (as in eval.bench.capture). Prints the table; writes `--out` (default
eval/results/bench/memory.json).
"""

from __future__ import annotations

import argparse
import json

from eval.common import MALLOC_ENV, RESULTS, child_env, estimate_cases, write_estimates
from pruner.core.proc_status import PeakGrowth
from pruner.core.tables import markdown_table

CASES = ["gpt2-shakespeare:8:128:0", "gpt2-shakespeare:8:128:1", "llama-shakespeare:8:128:0",
         "llama-shakespeare:8:1024:0", "llama-shakespeare:2:1024:1", "minilm-causal:8:512:0", "minilm-causal:8:512:1",
         "gpt2-small-random:4:512:0", "gpt2-small-random:2:1024:0", "gpt2-small-random:1:1024:1"]


def _model(name: str):
    import torch
    import transformers as tf

    from pruner.checkpoints import loading
    from pruner.core import shapes

    if name == "gpt2-small-random":  # GPT-2 small's shape, random weights (no download)
        torch.manual_seed(0)
        return tf.GPT2LMHeadModel(shapes.config("gpt2-small")).eval()
    return loading.load_model(name)


def case(spec: str) -> dict:
    import torch

    from pruner.attention.capture import CaptureConfig
    from pruner.attention.sinks import SinkSpec
    from pruner.core.data import TokenBatch
    from pruner.pruning.calibrate import CalibrationOptions, calibrate
    from pruner.runs import resources

    name, B, T, grad = spec.split(":")
    B, T, grad = int(B), int(T), bool(int(grad))
    torch.set_num_threads(2)
    model = _model(name)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (B, T), generator=g)
    ids[:, 0] = 1
    batch = TokenBatch(ids, torch.ones_like(ids))
    with torch.no_grad():
        model(input_ids=ids[:1, :8])
    est = resources.calibration_estimate(model, resources.Sizes(batch_size=B, length=T, chunk_size=128,
                                                                pair_metrics=1, outputs=True, gradient=grad))
    with PeakGrowth() as peak:
        calibrate(model, batch, SinkSpec("first"),
                  config=CaptureConfig(chunk_size=128, metrics=("cosine",), outputs=True),
                  options=CalibrationOptions(gradient=grad, batch_size=B))
    measured = peak.bytes
    return {"case": spec, "model": name, "batch_size": B, "length": T, "gradient": grad,
            "model_bytes": est.parts["model"], "estimate_bytes": est.total - est.parts["model"],
            "estimate_parts": est.parts, "measured_bytes": measured}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "bench" / "memory.json"))
    args = ap.parse_args()
    if args.case:
        print(json.dumps(case(args.case)))
        return
    rows = estimate_cases(__spec__.name, args.cases.split(","), child_env(**MALLOC_ENV, OMP_NUM_THREADS="2"))
    print(markdown_table(
        ["model", "batch x length", "gradient", "model MiB", "estimated MiB", "measured MiB", "estimate / measured"],
        [[r["model"], f"{r['batch_size']} x {r['length']}", "yes" if r["gradient"] else "no",
          f"{r['model_bytes'] / 2**20:.0f}", f"{r['estimate_bytes'] / 2**20:.0f}", f"{r['measured_bytes'] / 2**20:.0f}",
          f"{r['estimate_bytes'] / max(r['measured_bytes'], 1):.2f}"] for r in rows]))
    write_estimates(args.out, rows, "VmHWM growth during calibrate (clear_refs=5), fresh process per case, glibc "
                                    "mmap threshold 128 KiB")


if __name__ == "__main__":
    main()
