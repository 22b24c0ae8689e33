"""The ideal gains of removing heads: what the removed heads account for, from the geometry alone.

Pure arithmetic on a `Shape` (per-layer head counts and the weights around them);
`pruner.evaluation.ideal.shape_of` reads a model's Shape and measures how close the compact
model comes to these figures: parameters -- the q rows and output columns of every
removed query head, the k and v rows of every removed KV head (biases included);
KV cache -- removed KV heads; prefill time -- FLOPs, 2 per weight entry per token
plus 4 d_head per query head per (query, key) pair the causal mask keeps; decode
time -- bytes moved per step, every weight once plus the KV cache each row reads;
peak memory -- weights plus the case's KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from pruner.core import arch, runtime


@dataclass(frozen=True)
class Shape:
    """What the ideal gains are computed from: per-layer head counts and the weights around them."""

    q_heads: tuple[int, ...]     # query heads per layer
    kv_heads: tuple[int, ...]    # key/value heads per layer
    d_model: int
    d_head: int
    q_head_params: int           # one query head's q rows (+ bias)
    o_head_params: int           # one query head's output-projection columns
    kv_head_params: int          # one KV head's k and v rows (+ biases)
    other_weights: tuple[int, ...]  # per layer, entries of every other matrix of the block (MLP)
    logits_width: int            # entries of the LM-head matrix (d_model x vocab); 0 without one
    params: int                  # all parameters
    read_params: int             # parameters a decode step reads (all but input-only embedding tables)
    itemsize: int                # bytes per weight / cache entry
    causal: bool

    def attention_params(self) -> int:
        return sum(q * (self.q_head_params + self.o_head_params) + kv * self.kv_head_params
                   for q, kv in zip(self.q_heads, self.kv_heads))

    def with_heads(self, q_heads: tuple[int, ...], kv_heads: tuple[int, ...]) -> "Shape":
        """The same model with fewer heads: what head removal alone would leave."""
        cut = self.attention_params() - replace(self, q_heads=q_heads, kv_heads=kv_heads).attention_params()
        return replace(self, q_heads=tuple(q_heads), kv_heads=tuple(kv_heads), params=self.params - cut,
                       read_params=self.read_params - cut)


def kv_bytes_per_token(s: Shape) -> int:
    """Keys and values of one token in every layer."""
    return sum(2 * kv * s.d_head * s.itemsize for kv in s.kv_heads)


def prefill_flops(s: Shape, T: int, logits: int = 1) -> float:
    """Multiply-adds x 2 of one forward over T tokens, batch 1, `logits` positions through the LM head."""
    pairs = T * (T + 1) / 2 if s.causal else T * T  # (query, key) pairs each head scores
    per_layer = [2 * T * (s.d_model * s.d_head * (2 * q + 2 * kv) + other) + 4 * s.d_head * q * pairs
                 for q, kv, other in zip(s.q_heads, s.kv_heads, s.other_weights)]
    return sum(per_layer) + 2 * logits * s.logits_width


def decode_bytes(s: Shape, batch: int, context: float) -> float:
    """Bytes one decode step moves: every weight once, and the KV cache of `context` tokens per row."""
    return s.read_params * s.itemsize + batch * context * kv_bytes_per_token(s)


def resident_bytes(s: Shape, cached_tokens: int) -> float:
    """Weights plus a KV cache of `cached_tokens` tokens (all rows together)."""
    return s.params * s.itemsize + cached_tokens * kv_bytes_per_token(s)


def saving(base: float, pruned: float) -> float:
    return 1 - pruned / base if base else 0.0


def module_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def shape_of(model, kept: dict[int, list[int]] | None = None) -> Shape:
    """The Shape of an unpruned model (`kept`: the heads a pruned copy keeps; default all)."""
    ad, g = arch.adapter_for(model), arch.geometry(model)
    block = arch.blocks(model)[0]
    d_model = arch.o_weight_cols(model, 0).shape[0]
    if ad.qkv_layout == "separate":
        q_bias = arch.get(block, ad.q).bias is not None
        kv_bias = arch.get(block, ad.k).bias is not None
    else:
        q_bias = kv_bias = arch.get(block, ad.qkv).bias is not None
    hd = g.head_dim
    attn_weights = g.n_heads * 2 * d_model * hd + g.n_kv_heads * 2 * d_model * hd
    other = tuple(sum(p.numel() for p in b.parameters() if p.dim() >= 2) - attn_weights for b in arch.blocks(model))
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding_only = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    elsewhere = {id(p) for m in model.modules() if not isinstance(m, nn.Embedding)
                 for p in m.parameters(recurse=False)}
    read = sum(p.numel() for p in model.parameters() if id(p) not in embedding_only or id(p) in elsewhere)
    full = Shape(q_heads=(g.n_heads,) * g.n_layers, kv_heads=(g.n_kv_heads,) * g.n_layers, d_model=d_model,
                 d_head=hd, q_head_params=hd * d_model + hd * q_bias, o_head_params=hd * d_model,
                 kv_head_params=2 * (hd * d_model + hd * kv_bias), other_weights=other,
                 logits_width=out_emb.weight.numel() if out_emb is not None else 0,
                 params=module_params(model), read_params=read,
                 itemsize=next(model.parameters()).element_size(), causal=runtime.attends_causally(model))
    if kept is None:
        return full
    heads = [kept[layer] for layer in range(g.n_layers)]
    return full.with_heads(tuple(len(h) for h in heads), tuple(len({x // g.group_size for x in h}) for h in heads))
