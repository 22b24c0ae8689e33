"""The calibration capture, layer by layer (`capture.onload: sequential`): the same sums, one block resident.

`capture_layerwise` runs the same `Capture` -- the same attention function, the same fused kernel, the
same sums -- over `pruner.core.layerwise`: the inputs of block 0 for every batch are captured once,
then each block is onloaded, every batch's hidden states go through it (the attention function told
which batch it sees), the layer's sums move to the host, and the block is offloaded before the next.
Statistics equal the all-resident pass's (float64 sums of the same float32 products; the tests hold
them to 1e-10 relative) and so do the plans. What is kept between blocks: the hidden states of every
calibration window (`storage`: the host by default) and the finished layers' sums.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from pruner.attention.capture import Capture, CaptureConfig
from pruner.attention.sinks import SinkSpec
from pruner.attention.sums import HeadStats, LayerStats
from pruner.core import arch, distributed
from pruner.core.data import TokenBatch
from pruner.core.layerwise import BlockHooks, Onloader, PassOptions, first_block_calls, run_blocks, spilled


@dataclass(frozen=True)
class LayerEnd:
    """What a layer-by-layer capture does with a layer's sums once they are final (both optional).

    `finish(layer, sums, r)`, on rank 0 once the layer's sums are totals over every process and while its block
    is still in memory, returns what is kept of them (what a caller computes from a layer's whole sums and its
    weights, and then drops: `pruner.pruning.per_layer`); `r` is the layer's mean squared residual norm.
    `rerun(layer, sums)`, given the layer's finished sums (over every process), may return a context -- the block
    pruned and compensated, say -- in which the layer's batches run again, uncaptured, for the next block to see
    (`pruner.core.layerwise.run_blocks`); the sums are then the caller's: they are not kept.
    """

    finish: Callable[[int, LayerStats, torch.Tensor], LayerStats] | None = None
    rerun: Callable[[int, LayerStats], AbstractContextManager | None] | None = None


def capture_layerwise(model, batch: TokenBatch, sinks: SinkSpec, tokenizer, config: CaptureConfig,
                      onloader: Onloader, options: PassOptions = PassOptions(), end: LayerEnd = LayerEnd()
                      ) -> HeadStats | None:
    """`capture_stats` with one block resident at a time (see the module docstring), in `options`' batches on
    its device. `end`: what is done with each layer's finished sums (`LayerEnd`); with `end.rerun` the sums are
    the caller's and nothing is returned (one layer's sums in memory at a time, each reduced over processes
    once). Otherwise, with several processes, each layer's sums are reduced as the layer finishes and only rank 0
    keeps them: the other processes get None (memory per process flat in their number, and one copy of the sums
    per run)."""
    if sinks.mode == "auto" or config.across_layers:
        raise ValueError("capture.onload: sequential captures pruning's statistics; auto sinks and the model-wide "
                         "pairs of `analyze` need every layer at once (capture.onload: all)")
    finish, rerun, batch_size = end.finish, end.rerun, options.batch_size
    device = torch.device(options.device)
    g = arch.geometry(model)
    folds, parts, reduce_now = _share(batch, config, batch_size, rerun is not None)
    bar = tqdm(total=g.n_layers, desc="capture (layer by layer)", unit="layer") if options.progress else None
    with Capture(model, sinks, tokenizer, config) as cap:
        views = [cap.forward_batch(b.input_ids.to(device), b.attention_mask.to(device),
                                   None if folds is None else folds[i * batch_size:(i + 1) * batch_size])
                 for i, b in enumerate(parts)]
        calls = first_block_calls(model, [(b.input_ids, b.attention_mask) for b in parts], device, options.storage)

        def after_layer(layer: int) -> None:
            cap.use_batch(None)
            if layer in cap.layers:  # only this layer's sums stay where the block computed them
                cap.layers[layer] = _to_host(cap.layers[layer], device)
            if rerun is None and (reduce_now or finish is not None):  # reduced as it finishes: rank 0 alone keeps it
                total = distributed.reduce_tree(cap.layers.pop(layer), to_root=True)
                r = None if finish is None else _residual(views, layer)
                if total is not None:
                    total = total.completed()
                    cap.layers[layer] = (total if finish is None else finish(layer, total, r)).stored(config.moments)
                cap.reduced.add(layer)

        def again(layer: int) -> AbstractContextManager | None:
            return rerun(layer, distributed.reduce_tree(cap.layers.pop(layer)).completed())

        hooks = BlockHooks(lambda layer, i: cap.use_batch(views[i]), after_layer, None if rerun is None else again)
        with spilled(onloader) as spill:
            run_blocks(onloader, calls, g.n_layers, device, hooks, bar, spill=spill)
        for view in views:
            cap.add_residual(view)
    if bar is not None:
        bar.close()
    return None if rerun is not None else cap.result()


def _share(batch: TokenBatch, config: CaptureConfig, batch_size: int, rerun: bool):
    """This process's share of the windows: (each window's fold (N,) or None, its batches, whether each layer is
    reduced over processes as it finishes). A pass that reduces each layer as it goes needs a window on every
    process (else a process would wait forever)."""
    K = config.folds
    folds = torch.tensor(distributed.shard_indices(len(batch)), dtype=torch.long) % K if K else None
    mine = distributed.shard(batch)
    reduce_now = distributed.world_size() > 1 or config.moments != "float64"
    _check_windows(len(batch), len(mine), rerun or reduce_now)
    return folds, list(mine.batches(batch_size)), reduce_now


def _check_windows(n_windows: int, n_mine: int, reduces_per_layer: bool) -> None:
    """A pass that reduces each layer as it goes needs a window on every process."""
    if reduces_per_layer and min(distributed.all_objects(n_mine)) == 0:
        raise ValueError(f"{distributed.world_size()} processes and {n_windows} calibration windows: a layer-by-layer "
                         "pass that reduces each layer as it goes needs a window for every process; use fewer "
                         "processes or more calibration.num_samples")


def _residual(views: list, layer: int) -> torch.Tensor | None:
    """The mean squared norm of the residual stream entering `layer` over every process's real tokens (on rank 0;
    None elsewhere): what the scorers divide a layer's costs by."""
    mine = torch.stack([sum(v.residual[layer] for v in views), sum(v.mask2d.sum().double().cpu() for v in views)])
    total = distributed.reduce_tree(mine, to_root=True)
    return None if total is None else total[0] / total[1]


def _to_host(sums: LayerStats, device: torch.device) -> LayerStats:
    """A finished layer's sums on the CPU: from a GPU as page-locked, asynchronous copies with one wait for the
    layer (not a synchronous copy per tensor)."""
    gpu = device.type == "cuda"
    sums = sums.to("cpu", non_blocking=gpu)
    if gpu:
        torch.cuda.synchronize(device)
    return sums
