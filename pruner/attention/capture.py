"""Streaming attention capture through transformers' `AttentionInterface`.

`Capture` registers an attention function that computes each layer's attention
itself, in query chunks: the scores of a chunk once (float32, GQA by grouping the
queries of each KV head), one softmax, and from those probabilities both the
output the model continues with and every statistic (`pruner.attention.kernel.attend`): no
score is computed twice. It never holds layers x heads x T x T: the extra memory
is two chunk buffers, O(batch x heads x chunk x T), reused across chunks and
layers, plus the layer's sink channel (batch x T x heads x d_head) when output
moments are asked. The model's attention implementation is restored on exit,
whatever happens inside. Calibration needs no logits, so `run` calls the model's
body (`model.base_model`) and skips the language-model head.

Two cases keep SDPA for the output and recompute the scores for the statistics:
`auto` sinks (only the attention each key receives is measured) and
`CaptureConfig(across_layers=True)`, which compares every head with every head
of the model (`HeadStats.model_pairs`, for clustering and maps of all heads):
each layer's post-RoPE queries and keys (not repeated for GQA) are kept until the
forward pass ends, then the scores of all layers are stacked on one head axis and
folded chunk by chunk. Extra memory there: the kept q and k, 2 x layers x batch x
heads x T x d_head, plus one stacked chunk O(batch x layers*heads x chunk x T) and
its pair matrices O(batch x chunk x (layers*heads)^2) -- bounded by the batch,
fine at analysis sizes, not meant for long contexts of large models.

    with Capture(model, sinks, tokenizer) as cap:
        cap.run(batch)                      # any number of batches
    head_stats = cap.result()               # pruner.attention.sums.HeadStats
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from tqdm.auto import tqdm

from pruner.attention import kernel as st
from pruner.attention import moments, sums
from pruner.attention.autosinks import auto_sink_spec
from pruner.attention.batch import ForwardBatch, valid_keys
from pruner.attention.config import CaptureConfig
from pruner.attention.layer_cosine import cosine_hooks
from pruner.attention.sinks import SinkSpec, sink_mask
from pruner.core import arch, distributed, resume
from pruner.core.data import TokenBatch
from pruner.core.runtime import forward, input_device

IMPL = "pruner_capture"
_ACTIVE: "Capture | None" = None


def _up(x: torch.Tensor) -> torch.Tensor:
    """Half precision up to float32 (float32 and float64 kept), contiguous: scores are computed in float32."""
    return (x if x.dtype in (torch.float32, torch.float64) else x.float()).contiguous()


def _first_keys(mask: torch.Tensor | None, k1: int) -> torch.Tensor | None:
    """An attention mask cut to its first k1 keys (no mask stays none)."""
    return None if mask is None else mask[..., :k1]


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered attention function: fused output + statistics, or SDPA output + recomputed statistics."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cap = _ACTIVE
    if cap is not None and cap._fuses(dropout, kwargs):
        return cap._attend(module, query, key, value, attention_mask, scaling), None
    out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                 dropout=dropout, **kwargs)
    if cap is not None:
        cap._observe(module, query, key, value, attention_mask, scaling)
    return out


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if IMPL not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(IMPL, _capture_attention)
        AttentionMaskInterface.register(IMPL, sdpa_mask)


class Capture:
    """Scoped streaming capture: installs the attention function, always restores the model."""

    def __init__(self, model, sinks: SinkSpec, tokenizer=None, config: CaptureConfig = CaptureConfig()):
        self.model, self.sinks, self.tokenizer, self.config = model, sinks, tokenizer, config
        self.layers: dict[int, sums.LayerStats] = {}
        self.reduced: set[int] = set()  # layers whose sums are already totals over every process (layer by layer)
        self._batch: ForwardBatch | None = None
        self._saved_impl: str | None = None
        self._received: list[list] = []  # auto sinks: [ids, mask, received sums, row counts] per batch
        self._residual: torch.Tensor | None = None  # (layer,) sums of ||h||^2 over real tokens
        self._cosine: torch.Tensor | None = None  # (layer,) sums of cos(h, h + attention) over real tokens
        self._tokens = 0
        self._kept: dict[int, tuple] = {}  # across_layers: layer -> (query, key, mask, scale, causal, bf16)
        self._n_layers = 0  # across_layers: self.layers holds one stacked entry of all layers' heads
        self._work = st.Workspace()
        self._hooks: list = []

    def __enter__(self) -> "Capture":
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("another Capture is already active")
        _register()
        if self.config.outputs:  # the residual stream entering each block, which its heads write into
            self._hooks = [b.register_forward_pre_hook(self._residual_hook, with_kwargs=True)
                           for b in arch.blocks(self.model)]
        if self.config.layer_cosine:  # ... and leaving its attention sub-block
            self._hooks += cosine_hooks(self.model, lambda: self._batch)
        self._saved_impl = self.model.config._attn_implementation
        self.model.set_attn_implementation(IMPL)
        _ACTIVE = self
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        _ACTIVE = None
        for h in self._hooks:
            h.remove()
        self._hooks, self._work = [], st.Workspace()
        self.model.set_attn_implementation(self._saved_impl)

    @torch.no_grad()
    def run(self, batch: TokenBatch, batch_size: int = 8, progress: bool = False,
            checkpoints: resume.Checkpoints = resume.NONE, name: str = "capture") -> None:
        """Forward every sample once through the model's body (no logits), accumulating statistics.

        With `checkpoints`, the sums so far and the batch cursor are saved as stage `name`
        when due, and a resumed run starts after the last saved batch (one `run` per
        stage: the restored sums replace this Capture's).
        """
        if _ACTIVE is not self:
            raise RuntimeError("Capture.run must be called inside `with Capture(...)`")
        device = input_device(self.model)  # the first device under a device_map
        K = self.config.folds  # sample i of the whole batch is in fold i mod K, whichever process takes it
        folds = torch.tensor(distributed.shard_indices(len(batch)), dtype=torch.long) % K if K else None
        batch = distributed.shard(batch)  # several processes: every world-th sample; result() reduces
        n_batches = -(-len(batch) // batch_size)
        done = self._restore(checkpoints.load(name))
        it = itertools.islice(batch.batches(batch_size), done, None)
        if progress:
            it = tqdm(it, total=n_batches, initial=done, desc="capture", unit="batch")
        for k, b in enumerate(it, start=done + 1):
            ids, mask2d = b.input_ids.to(device), b.attention_mask.to(device)
            self._batch = self.forward_batch(ids, mask2d, None if folds is None else
                                             folds[(k - 1) * batch_size:k * batch_size])
            try:
                forward(self.model.base_model, ids, mask2d, use_cache=False)  # no logits, no KV cache
                if self._kept:
                    self._fold_across_layers()
                done_batch = self._batch
            finally:
                self._batch = None
                self._kept = {}
            self.add_residual(done_batch)
            checkpoints.step(name, k, lambda: self.state(k))
        checkpoints.finish(name, lambda: self.state(n_batches))

    def forward_batch(self, ids: torch.Tensor, mask2d: torch.Tensor, folds: torch.Tensor | None) -> ForwardBatch:
        """What the attention function needs about a batch (sinks, counted rows, folds), for one pass or for every
        block of a layer-by-layer pass (`pruner.attention.sequential`)."""
        if self.sinks.mode == "auto":  # no sinks yet: only measure received attention
            sink = torch.zeros_like(mask2d, dtype=torch.bool)
            self._received.append([ids.cpu(), mask2d.cpu(), 0.0, 0.0])
        else:
            sink = sink_mask(ids, mask2d, self.sinks, self.tokenizer)
        return ForwardBatch(mask2d, sink, mask2d.bool() & ~sink, folds=folds)

    def use_batch(self, batch: ForwardBatch | None) -> None:
        """The batch the attention function sees next (a layer-by-layer pass sets it before every call)."""
        if _ACTIVE is not self:
            raise RuntimeError("Capture.use_batch must be called inside `with Capture(...)`")
        self._batch = batch

    def add_residual(self, batch: ForwardBatch) -> None:
        """The residual stream's squared norms the batch's blocks saw, and its tokens (with output moments)."""
        if self.config.outputs:
            sq = torch.stack(batch.residual)
            self._residual = sq if self._residual is None else self._residual + sq
            self._tokens += int(batch.mask2d.bool().sum())
        if self.config.layer_cosine:
            cos = torch.stack(batch.cosine)
            self._cosine = cos if self._cosine is None else self._cosine + cos

    def state(self, cursor: int) -> dict:
        """The sums so far and how many of this process's batches they hold (`pruner.core.resume`)."""
        return {"cursor": cursor, "layers": resume.plain(self.layers), "residual": self._residual,
                "cosine": self._cosine, "tokens": self._tokens, "received": resume.plain(self._received),
                "n_layers": self._n_layers}

    def _restore(self, state: dict | None) -> int:
        """Put saved sums back (each layer's on the device its attention runs on); returns the cursor."""
        if state is None:
            return 0
        if self.layers or self._received or self._tokens:
            raise RuntimeError("a resumed capture must start empty (one Capture.run per checkpointed stage)")
        blocks = arch.blocks(self.model)
        layers = resume.unplain(state["layers"], {"LayerStats": sums.LayerStats, "OutputMoments": moments.OutputMoments,
                                                  "FoldMoments": moments.FoldMoments})
        self.layers = {i: s.to(next(blocks[i].parameters()).device) for i, s in layers.items()}
        self._residual, self._tokens, self._cosine = state["residual"], state["tokens"], state.get("cosine")
        self._received, self._n_layers = state["received"], state["n_layers"]
        return state["cursor"]

    def _residual_hook(self, block, args, kwargs) -> None:
        """Block pre-hook: sum of ||h||^2 over this batch's real tokens of the stream entering the block."""
        if self._batch is None:
            return
        h = (args[0] if args else kwargs["hidden_states"]).float()  # (B, T, d_model)
        sq = torch.einsum("btd,btd->bt", h, h)  # per token, float32
        self._batch.residual.append(sq[self._batch.mask2d.to(h.device).bool()].double().sum().cpu())
        if self.config.layer_cosine:  # what the block's attention turns (`pruner.attention.layer_cosine`)
            self._batch.entering[len(self._batch.residual) - 1] = h

    def _fuses(self, dropout: float, kwargs: dict) -> bool:
        """Whether this attention call runs the fused path (else SDPA output + `_observe`)."""
        return (self._batch is not None and self.config.fused and self.sinks.mode != "auto"
                and not self.config.across_layers and not dropout
                and all(kwargs.get(k) is None for k in ("position_bias", "softcap", "s_aux")))

    def _attend(self, module, query, key, value, mask, scaling) -> torch.Tensor:
        """One layer, chunk by chunk: scores, one softmax, output and statistics (`pruner.attention.kernel.attend`).

        Returns what transformers expects from an attention function: (B, T, H, d_head)
        in the model's dtype. Half-precision inputs are computed in float32 (bfloat16:
        q k^T on bfloat16 / TF32 units, exact; see `stats.matmul_precision`).
        """
        B, H, T, D = query.shape
        if key.shape[2] != T:
            raise RuntimeError("capture needs whole sequences (no KV cache, no cross-attention)")
        inputs = st.AttentionInputs(_up(query), _up(key), _up(value), scaling if scaling is not None else D ** -0.5,
                                    query.dtype)
        keys = self._batch.layer_keys(mask, self.config.chunk_size, getattr(module, "is_causal", True),
                                      query.device)  # device_map: this layer's device
        out, u, total = st.attend(inputs, keys, self.config.metrics, self.config.dormant_threshold, self._work)
        layer = module.layer_idx
        if self.config.outputs:
            rows = self._batch.mask2d.to(query.device)  # every real token's output, sinks included
            bf16 = query.dtype == torch.bfloat16
            running = self.layers.get(layer)
            folds = None if self._batch.folds is None else moments.fold_moments(  # into the running sums, in place
                out, rows, self._batch.folds, self.config.folds, bf16, None if running is None else running.folds)
            total = dataclasses.replace(total, outputs=moments.output_moments(out, u, rows, bf16, folds,
                                                                        self.config.channels, self.config.joint),
                                        folds=folds)
        self._accumulate(layer, total)
        return out

    def _accumulate(self, layer: int, part: sums.LayerStats) -> None:
        """A batch's sums added to the layer's running sums in place (the first batch's become them)."""
        if layer in self.layers:
            self.layers[layer].add_(part)
        else:
            self.layers[layer] = part

    def _observe(self, module, query, key, value, mask, scaling) -> None:
        """Statistics beside an SDPA output: received attention (auto sinks), kept q/k (across layers), or
        a layer whose attention call the fused path does not cover."""
        if self._batch is None:
            return
        if self.config.outputs:
            raise ValueError("output moments need pruner's fused attention, which this attention call does not "
                             "allow (dropout in training mode, a position bias, softcapping or attention sinks)")
        mask2d, sink, rows = self._batch.on(query.device)  # device_map: this layer's device
        B, H, T, D = query.shape
        if key.shape[2] != T:
            raise RuntimeError("capture needs whole sequences (no KV cache, no cross-attention)")
        bf16 = query.dtype == torch.bfloat16
        query, key = _up(query), _up(key)  # half precision: scores in float32
        scale = scaling if scaling is not None else D ** -0.5
        causal = getattr(module, "is_causal", True)
        if self.config.across_layers and self.sinks.mode != "auto":
            self._kept[module.layer_idx] = (query, key, mask, scale, causal, bf16)
            return
        total = None
        for q0 in range(0, T, self.config.chunk_size):
            q1 = min(T, q0 + self.config.chunk_size)
            k1 = q1 if causal else T  # causal: keys after the chunk's last query are never visible
            z = st.scores(query[:, :, q0:q1], key[:, :, :k1], scale, bf16=bf16)  # (B, H, c, k1)
            valid = valid_keys(None if mask is None else mask[..., :k1], mask2d[:, :k1], q0, q1, causal)
            if self.sinks.mode == "auto":
                self._receive(z, valid, rows[:, q0:q1])
                continue
            part = st.chunk_stats(z, sink[:, :k1], valid, rows[:, q0:q1], self.config.metrics,
                                  self.config.dormant_threshold)
            total = part if total is None else total + part
        if total is None:
            return
        self._accumulate(module.layer_idx, total)

    def _fold_across_layers(self) -> None:
        """Stack every layer's scores on one head axis (layer-major) and fold them, chunk by chunk."""
        mask2d, sink, rows = self._batch.on(self._batch.mask2d.device)
        kept = [self._kept[i] for i in sorted(self._kept)]
        if len({q.shape[1] for q, *_ in kept}) != 1:
            raise ValueError("across_layers needs the same number of query heads in every layer")
        T = kept[0][0].shape[2]
        total = None
        for q0 in range(0, T, self.config.chunk_size):
            q1 = min(T, q0 + self.config.chunk_size)
            k1 = q1 if kept[0][4] else T  # causal: keys after the chunk's last query are never visible
            valid = valid_keys(_first_keys(kept[0][2], k1), mask2d[:, :k1], q0, q1, kept[0][4])  # (B, 1, c, k1)
            for _, _, mask, _, causal, _ in kept[1:]:
                if not torch.equal(valid_keys(_first_keys(mask, k1), mask2d[:, :k1], q0, q1, causal), valid):
                    window = getattr(self.model.config, "sliding_window", None)
                    raise ValueError("comparing heads across layers needs every layer to see the same keys; this "
                                     f"model's sliding-window layers see fewer than its global ones beyond its "
                                     f"sliding window of {window} tokens: analyse windows no longer than that")
            z = torch.cat([st.scores(q[:, :, q0:q1], k[:, :, :k1], scale, bf16=bf16)
                           for q, k, _, scale, _, bf16 in kept], dim=1)  # (B, L * H, c, k1)
            part = st.chunk_stats(z, sink[:, :k1], valid, rows[:, q0:q1], self.config.metrics,
                                  self.config.dormant_threshold)
            total = part if total is None else total + part
        self._accumulate(0, total)
        self._n_layers = len(kept)

    def _receive(self, z: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor) -> None:
        """Add attention received by each key, summed over heads and counted query rows."""
        a = torch.nan_to_num(torch.softmax(z.float().masked_fill(~valid, float("-inf")), dim=-1))
        w = rows[:, None, :, None].float()  # (B, 1, c, 1)
        rec = self._received[-1]
        pad = (0, rec[1].shape[1] - z.shape[-1])  # causal chunks see a prefix of the keys
        rec[2] = rec[2] + torch.nn.functional.pad((a * w).sum(dim=(1, 2)).double().cpu(), pad)  # (B, K)
        rec[3] = rec[3] + torch.nn.functional.pad((valid.float() * w).sum(dim=(1, 2)).double().cpu(), pad) \
            * z.shape[1]

    def auto_sinks(self) -> SinkSpec:
        """Resolve `auto`: positions and token ids whose mean received attention exceeds eps."""
        if self.sinks.mode != "auto" or not self._received:
            raise ValueError("auto_sinks needs a Capture with SinkSpec('auto') that has run")
        return auto_sink_spec(self._received, self.sinks.eps)

    def result(self) -> sums.HeadStats | None:
        """Finalised statistics; with several processes, of all their samples (each layer's sums reduced with
        tensor collectives, added in rank order: `distributed.reduce_tree`). Layers already reduced as they
        finished (`reduced`, layer by layer) stay where the reduction left them: on rank 0 only, so the other
        processes get None."""
        if self.reduced:
            layers = dict(self.layers)
        else:
            have = distributed.all_objects(sorted(self.layers))
            if any(h != have[0] for h in have):  # a process without samples: the others' layers, merged as objects
                layers = {}
                for part in distributed.all_objects({i: s.to("cpu") for i, s in self.layers.items()}):
                    for i, s in part.items():
                        layers[i] = s if i not in layers else layers[i] + s
            else:
                layers = {i: distributed.reduce_tree(self.layers[i].to("cpu")) for i in have[0]}
        layers = {i: s.completed().stored(self.config.moments) for i, s in layers.items()}
        residual, tokens, cosine = self._residual, self._tokens, self._cosine
        if self.config.outputs and residual is not None:
            sums_ = [residual.double(), *([] if cosine is None else [cosine.double()]), torch.tensor([float(tokens)])]
            both = distributed.reduce_tree(torch.cat(sums_))
            residual, tokens = both[:len(residual)], float(both[-1])
            cosine = None if cosine is None else both[len(residual):-1]
        if self.reduced and not distributed.is_main():
            return None
        if not layers:
            raise ValueError("nothing captured: run at least one batch")
        stats = sums.finalize([layers[i] for i in sorted(layers)])
        if self.config.across_layers:  # one stacked "layer" of every head: split it back into layers
            return sums.unstack_layers(stats, self._n_layers)
        if residual is not None:
            stats = dataclasses.replace(stats, residual=residual / tokens,
                                        attn_cosine=None if cosine is None else cosine / tokens)
        return stats


def resolve_auto_sinks(model, batch: TokenBatch, tokenizer=None, eps: float = 0.3,
                       config: CaptureConfig = CaptureConfig(), batch_size: int = 8,
                       checkpoints: resume.Checkpoints = resume.NONE) -> SinkSpec:
    """Data-driven sinks (Gu et al. 2025 Sink_eps): keys whose mean received attention exceeds eps.

    Mean over layers, heads and the counted query rows that can see the key; keys
    are grouped by position (from the first real token) and by token id.
    """
    with Capture(model, SinkSpec("auto", eps=eps), tokenizer, config) as cap:
        cap.run(batch, batch_size=batch_size, checkpoints=checkpoints, name="auto-sinks")
    return cap.auto_sinks()


def capture_stats(model, batch: TokenBatch, sinks: SinkSpec, tokenizer=None,
                  config: CaptureConfig = CaptureConfig(), batch_size: int = 8,
                  progress: bool = False, checkpoints: resume.Checkpoints = resume.NONE) -> sums.HeadStats:
    """One call: capture statistics of `batch` and return the finalised head statistics (checkpointed as stage
    `capture`; another stage name: `Capture.run`)."""
    with Capture(model, sinks, tokenizer, config) as cap:
        cap.run(batch, batch_size=batch_size, progress=progress, checkpoints=checkpoints, name="capture")
    return cap.result()


__all__ = ["Capture", "CaptureConfig", "capture_stats", "resolve_auto_sinks"]  # CaptureConfig: from .config
