"""The reference the capture is tested against: its statistics computed from stored eager attention maps.

It materialises layers x heads x T x T (`output_attentions=True`), exactly what the streaming capture avoids,
and is the obvious, trustworthy computation: the tests hold `pruner.attention.capture` equal to it.
"""

from __future__ import annotations

import torch

from pruner.attention import kernel, sums
from pruner.attention.sinks import sink_mask
from pruner.core.data import TokenBatch
from pruner.core.runtime import attends_causally, forward


@torch.no_grad()
def eager_stats(model, batch: TokenBatch, sinks, tokenizer=None, metrics: tuple[str, ...] = ("cosine", "js"),
                batch_size: int = 8, dormant_threshold: float = 0.9) -> sums.HeadStats:
    """The statistics of `pruner.attention.capture`, computed from stored eager maps.

    The scores are taken as log(a): softmax(log a) = a, so `chunk_stats` sees the
    very rows the eager model produced, in one chunk of all T queries.
    """
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    causal = attends_causally(model)
    layers: list = []
    try:
        for b in batch.batches(batch_size):
            maps = forward(model, b.input_ids, b.attention_mask,
                           output_attentions=True).attentions  # layer x (B, H, T, T)
            sink = sink_mask(b.input_ids, b.attention_mask, sinks, tokenizer)
            rows = b.attention_mask.bool() & ~sink
            T = b.input_ids.shape[1]
            valid = b.attention_mask.bool()[:, None, None, :].expand(-1, 1, T, -1)
            if causal:
                valid = valid & torch.ones(T, T, dtype=torch.bool).tril()
            for i, a in enumerate(maps):
                z = torch.log(a.double()).masked_fill(~valid, 0.0)
                part = kernel.chunk_stats(z, sink, valid, rows, metrics, dormant_threshold)
                if len(layers) <= i:
                    layers.append(part)
                else:
                    layers[i] = layers[i] + part
    finally:
        model.set_attn_implementation(impl)
    return sums.finalize(layers)
