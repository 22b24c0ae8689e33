"""Architecture adapters: where each family keeps its attention weights. Data, not code.

Paths are relative to `model.base_model` (layers) and to one block (the rest),
so `GPT2Model` and `GPT2LMHeadModel`, `BertModel` and `BertLMHeadModel` share an
adapter. Head geometry comes from the config; weights are sliced by head using
`qkv_layout`:

- `separate`  -- q, k, v are three projections (Llama, BERT);
- `split`     -- one fused projection laid out [q | k | v] (GPT-2 `c_attn`);
- `per_head`  -- one fused projection laid out per head [q_h, k_h, v_h] (GPT-NeoX).

`conv1d` marks GPT-2's Conv1D, whose weight is stored (in, out).
`explicit_head_dim` marks families whose attention reads `config.head_dim` when
present (Llama, Mistral, Qwen2, Qwen3, Gemma 3): a vanilla config of theirs can describe
fewer heads of the same width. GPT-2, BERT and GPT-NeoX derive it from
hidden_size / heads. `bias_flag` names the config switch that gives the attention projections a
bias (Llama's `attention_bias`), used to fold mean compensation into a model
whose output projection has none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import reduce

import torch


@dataclass(frozen=True)
class Adapter:
    layers: str
    attn: str                      # module that receives (query, key, value): has `layer_idx`
    o_proj: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    qkv_layout: str = "separate"
    conv1d: bool = False
    bias_flag: str | None = None
    n_heads_attrs: tuple[str, ...] = ()  # module attributes holding the head count, kept in sync
    explicit_head_dim: bool = False
    post_attention: str | None = None  # the module whose input is the residual stream after the attention
    #                                    sub-block (h + attention's contribution): the layer-cosine scorer reads it
    attention_free: bool = False  # a layer may lose every head: surgery swaps in an attention-free module


_LLAMA = Adapter(layers="layers", attn="self_attn", o_proj="self_attn.o_proj", q="self_attn.q_proj",
                 k="self_attn.k_proj", v="self_attn.v_proj", bias_flag="attention_bias",
                 explicit_head_dim=True, post_attention="post_attention_layernorm", attention_free=True)
# Gemma 3 normalises the attention output before adding it: the stream after attention enters the pre-MLP norm
_GEMMA3 = replace(_LLAMA, post_attention="pre_feedforward_layernorm")
_BERT = Adapter(layers="encoder.layer", attn="attention.self", o_proj="attention.output.dense",
                q="attention.self.query", k="attention.self.key", v="attention.self.value",
                n_heads_attrs=("attention.self.num_attention_heads",))

ADAPTERS: dict[str, Adapter] = {
    "gpt2": Adapter(layers="h", attn="attn", o_proj="attn.c_proj", qkv="attn.c_attn", qkv_layout="split",
                    conv1d=True, n_heads_attrs=("attn.num_heads",), post_attention="ln_2"),
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    # Gemma 3's text model: Llama's names, q/k RMSNorms over d_head (shared by every head, untouched by surgery),
    # a norm after the attention output, sliding-window layers; `attention_bias` switches on all four biases
    "gemma3_text": _GEMMA3,
    "gpt_neox": Adapter(layers="layers", attn="attention", o_proj="attention.dense",
                        qkv="attention.query_key_value", qkv_layout="per_head"),
    "bert": _BERT,
    "roberta": _BERT,
}


class UnsupportedArchitecture(ValueError):
    pass


def adapter_for(model) -> Adapter:
    """The adapter of a model, or a clear error naming the supported families."""
    kind = model.config.model_type
    _refuse_per_layer(model.config)
    if kind not in ADAPTERS:
        raise UnsupportedArchitecture(f"architecture {kind!r} is not supported; supported: "
                                      f"{', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[kind]


def _refuse_per_layer(cfg) -> None:
    """A pruner per-layer checkpoint has no single head count: the geometry every stage assumes."""
    if getattr(cfg, "pruner_format", None):
        raise UnsupportedArchitecture(
            f"this is a pruner per-layer checkpoint ({cfg.model_type}: layers keep different head counts); pruner "
            "scores, prunes and analyses models with the same heads in every layer: use its base model (named in "
            "its model card), or run this one for inference (pruner.load)")


def get(module, path: str):
    return reduce(getattr, path.split("."), module)


def set_attr(module, path: str, value) -> None:
    *parent, name = path.split(".")
    setattr(reduce(getattr, parent, module), name, value)


def is_per_layer(model) -> bool:
    """Whether `model` is a pruner per-layer checkpoint's (layers keep different head counts)."""
    return bool(getattr(model.config, "pruner_format", None))


def names_adapter(model) -> Adapter:
    """The adapter whose module names `model` uses -- also a pruner per-layer checkpoint's (`pruned_<family>`):
    where its blocks and projections sit, which a layer-by-layer pass and recovery read; not its head counts."""
    family = model.config.model_type.removeprefix("pruned_")
    if is_per_layer(model) and family in ADAPTERS:
        return ADAPTERS[family]
    return adapter_for(model)


def layers_path(model) -> str:
    """Where the blocks sit under the base model -- also in a pruner per-layer checkpoint."""
    return names_adapter(model).layers


def blocks(model) -> list:
    """The transformer blocks, in order."""
    return list(get(model.base_model, layers_path(model)))


@dataclass(frozen=True)
class Geometry:
    """Head counts of the unpruned architecture."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 without GQA)."""
        return self.n_heads // self.n_kv_heads


def geometry(model) -> Geometry:
    """Head geometry of the *original* model (remembered, so surgery never renumbers heads)."""
    if getattr(model, "_pruner_geometry", None) is None:
        model._pruner_geometry = _read_geometry(model.config)
    return model._pruner_geometry


def _read_geometry(cfg) -> Geometry:
    _refuse_per_layer(cfg)
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    return Geometry(cfg.num_hidden_layers, n_heads, n_kv, head_dim)


def o_weight_cols(model, layer: int) -> torch.Tensor:
    """The output projection as (d_model, heads * d_head): columns are head channels."""
    ad = adapter_for(model)
    w = get(blocks(model)[layer], ad.o_proj).weight
    return w.t() if ad.conv1d else w


def o_bias(model, layer: int) -> torch.Tensor | None:
    """The output projection's bias (d_model,), or None where it has none."""
    return get(blocks(model)[layer], adapter_for(model).o_proj).bias


def qkv_weights(model, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v projection weights as (rows, d_model): q (heads*d_head), k and v (kv_heads*d_head)."""
    ad, g = adapter_for(model), geometry(model)
    block = blocks(model)[layer]
    if ad.qkv_layout == "separate":
        return tuple(get(block, p).weight for p in (ad.q, ad.k, ad.v))
    w = get(block, ad.qkv).weight
    w = w.t() if ad.conv1d else w  # (3 * heads * d_head, d_model)
    if ad.qkv_layout == "split":
        return tuple(w.chunk(3, dim=0))
    per_head = w.view(-1, 3, g.head_dim, w.shape[-1])  # (heads, [q, k, v], d_head, d_model)
    return tuple(per_head[:, i].reshape(-1, w.shape[-1]) for i in range(3))
