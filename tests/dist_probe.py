"""Run by tests/test_distributed.py in 1 process or under `torchrun --nproc_per_node 2`.

    [torchrun --standalone --nproc_per_node 2] tests/dist_probe.py OUT.pt

Calibrates a tiny GPT-2 and a tiny Llama (capture statistics with output moments,
gradient importance, whole and a block at a time), scores perplexity windows, selects plans and fits refit
compensation (one-shot and sequential); rank 0 saves it all.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    torch.set_num_threads(1)
    from tiny import ragged_batch, tiny_model

    from pruner.attention.capture import CaptureConfig, capture_stats
    from pruner.attention.sinks import SinkSpec
    from pruner.core import arch, distributed
    from pruner.core.data import pad
    from pruner.evaluation.perplexity import EvalWindows, window_nll
    from pruner.pruning.calibrate import CalibrationOptions, calibrate
    from pruner.pruning.compensation import compensate, refit_sequential
    from pruner.pruning.scoring import get_scorer
    from pruner.pruning.selection import SelectionConfig, select

    out = {}
    for family in ("gpt2", "llama"):
        model = tiny_model(family)
        batch = pad(ragged_batch(seed=3, n=7), 0)  # 7 samples: uneven shards (4 + 3)
        inputs = calibrate(model, batch, SinkSpec("first"), options=CalibrationOptions(gradient=True, batch_size=2))
        stats = {k: v for k, v in asdict(inputs.stats).items() if isinstance(v, torch.Tensor)}
        stats.update({f"pairs/{k}": v for k, v in inputs.stats.pairs.items()})
        stats.update({f"outputs/{i}/{k}": v for i, m in enumerate(inputs.stats.outputs)
                      for k, v in asdict(m).items()})
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        nll, count = window_nll(model, EvalWindows(batch.input_ids, batch.attention_mask, labels), batch_size=3)
        plans = {name: select(get_scorer(name), inputs, arch.geometry(model), SelectionConfig(target=0.25)).heads
                 for name in ("sink-aware", "gradient", "fluctuation", "refit-energy")}
        heads = plans["refit-energy"]
        refit = compensate(model, heads, inputs.stats.outputs, "refit")

        def collect():
            return capture_stats(model, batch, SinkSpec("first"), config=CaptureConfig(metrics=(), outputs=True),
                                 batch_size=2).outputs

        seq = refit_sequential(model, heads, collect)
        comp = {f"{name}/{kind}/{layer}": v for name, c in (("oneshot", refit), ("sequential", seq))
                for kind in ("bias", "weight") for layer, v in getattr(c, kind).items()}
        from pruner.attention.sequential import capture_layerwise
        from pruner.core.layerwise import PassOptions, Resident

        layered = capture_layerwise(model, batch, SinkSpec("first"), None, CaptureConfig(
            metrics=("cosine", "js"), outputs=True, folds=3), Resident(model, "cpu"), PassOptions(batch_size=2))
        if layered is not None:  # several processes: only rank 0 keeps the layer-by-layer sums
            stats.update({f"layerwise/outputs/{i}/joint": m.joint for i, m in enumerate(layered.outputs)})
            stats.update({f"layerwise/folds/{i}/joint": m.joint for i, m in enumerate(layered.folds)})
            stats["layerwise/sink_mass"] = layered.sink_mass
        out.setdefault("kept", {})[family] = distributed.all_objects(layered is not None)
        from pruner.pruning.layerwise import gradient_layerwise

        grad_layerwise = gradient_layerwise(model, batch, None, Resident(model, "cpu"), batch_size=2)
        out[family] = {"stats": stats, "gradient": inputs.gradient, "gradient_layerwise": grad_layerwise,
                       "cross": inputs.cross,
                       "nll": nll, "count": count, "plans": plans, "refit": comp}
    if distributed.is_main():
        torch.save({"world": distributed.world_size(), **out}, sys.argv[1])


if __name__ == "__main__":
    main()
