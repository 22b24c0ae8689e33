"""Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text) with a different number of attention heads in each layer.

pruner (sink-aware attention-head pruning) writes this file next to the weights of
a checkpoint whose layers kept different numbers of attention heads, or whose
output projections carry a bias the family's config cannot declare. No vanilla
config can say either, so the checkpoint is loaded with

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

(or, without running this file, `pruner.load(folder)`, which uses pruner's own
copy of it). Everything is the vanilla transformers model except each layer's
attention projections, which are built with that layer's head counts, read from
config.json:

    num_attention_heads_per_layer   query heads kept in each layer
    num_key_value_heads_per_layer   key/value heads kept in each layer (GQA groups)
    o_proj_bias_per_layer           (optional) layers whose output projection has a bias

`num_attention_heads`, `num_key_value_heads` and `head_dim` keep the base model's
values: pruning removes heads, never narrows them. A layer with 0 heads (its whole
attention removed) runs `AttentionFree`: no attention kernel, no KV cache, its output
the projection's bias or zeros. Imports only transformers and torch.
"""

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma3TextModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MistralModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Model,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
)

FORMAT = "per-layer-heads/1"


def check_head_counts(config) -> None:
    """Refuse per-layer head counts the layers cannot have (a hand-edited config.json)."""
    q, kv = config.num_attention_heads_per_layer, config.num_key_value_heads_per_layer
    n = config.num_hidden_layers
    if len(q) != n or len(kv) != n:
        raise ValueError(f"config.json: num_attention_heads_per_layer ({len(q)}) and num_key_value_heads_per_layer "
                         f"({len(kv)}) need one entry per layer ({n})")
    for layer, (h, g) in enumerate(zip(q, kv)):
        if (h, g) != (0, 0) and not (1 <= g <= h and h % g == 0):  # (0, 0): a layer without attention
            raise ValueError(f"config.json: layer {layer} has {h} query heads over {g} key/value heads; "
                             "each key/value head needs the same whole number of query heads")


def resize_attention(model, config) -> None:
    """Give each layer's attention the projections of its own head counts (the weights load afterwards)."""
    o_bias = getattr(config, "o_proj_bias_per_layer", None) or [False] * config.num_hidden_layers
    for layer, block in enumerate(model.base_model.layers):
        attn = block.self_attn
        q, kv = config.num_attention_heads_per_layer[layer], config.num_key_value_heads_per_layer[layer]
        d, width, kv_width = config.hidden_size, q * attn.head_dim, kv * attn.head_dim
        qkv_bias = attn.q_proj.bias is not None  # Llama/Qwen3 `attention_bias`, Qwen2 always
        attn.q_proj = nn.Linear(d, width, bias=qkv_bias)
        attn.k_proj = nn.Linear(d, kv_width, bias=qkv_bias)
        attn.v_proj = nn.Linear(d, kv_width, bias=qkv_bias)
        attn.o_proj = nn.Linear(width, d, bias=attn.o_proj.bias is not None or bool(o_bias[layer]))
        attn.num_key_value_groups = q // kv if kv else 1  # what the attention forward reads to repeat k/v
        if q == 0:
            block.self_attn = AttentionFree(attn)


class TokenCount(DynamicLayer):
    """The full-attention cache entry of a layer with no heads: 0-head keys and values, its tokens counted --
    transformers reads the sequence length (positions, mask sizes) from layer 0's entry, which an empty tensor
    would report as 0."""

    def __init__(self, **kwargs):
        super().__init__()
        self.tokens = 0

    def update(self, key_states, value_states, *args, **kwargs):
        self.tokens += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.tokens

    def crop(self, max_length: int) -> None:
        self.tokens = max_length if max_length >= 0 else max(self.tokens + max_length, 0)
        super().crop(max_length)

    def reset(self) -> None:
        self.tokens = 0
        super().reset()


class AttentionFree(nn.Module):
    """A layer's attention with no head left: never calls the kernel (a 0-head view has no shape to infer);
    adds the output projection's bias, or zeros; keeps the cache's token count."""

    def __init__(self, attn):
        super().__init__()
        for name, child in attn.named_children():  # the empty projections and q/k norms keep their names
            self.add_module(name, child)
        self.layer_idx, self.head_dim, self.config = attn.layer_idx, attn.head_dim, attn.config

    def forward(self, hidden_states, *args, cache=None, past_key_values=None, **kwargs):
        B, T = hidden_states.shape[:2]
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            layers = cache.layers
            if len(layers) <= self.layer_idx and getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
                layers.extend(DynamicLayer() for _ in range(self.layer_idx + 1 - len(layers)))
            entry = layers[self.layer_idx] if len(layers) > self.layer_idx else None
            if type(entry) is DynamicLayer and not entry.is_initialized:
                layers[self.layer_idx] = TokenCount()
            empty = hidden_states.new_zeros(B, 0, T, self.head_dim)  # (B, 0 kv heads, T, d_head)
            cache.update(empty, empty, self.layer_idx)
        return self.o_proj(torch.zeros_like(hidden_states[..., :0])), None  # (B, T, d_model)


class PerLayerHeads:
    """Mixin: resize the attention projections before transformers initialises and loads the weights."""

    def post_init(self):
        resize_attention(self, self.config)
        super().post_init()


class PerLayerConfig:
    """Mixin: validate the per-layer head counts when the config is built."""

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_head_counts(self)


class PrunedLlamaConfig(PerLayerConfig, LlamaConfig):
    model_type = "pruned_llama"


class PrunedLlamaModel(PerLayerHeads, LlamaModel):
    config_class = PrunedLlamaConfig


class PrunedLlamaForCausalLM(PerLayerHeads, LlamaForCausalLM):
    config_class = PrunedLlamaConfig


class PrunedMistralConfig(PerLayerConfig, MistralConfig):
    model_type = "pruned_mistral"


class PrunedMistralModel(PerLayerHeads, MistralModel):
    config_class = PrunedMistralConfig


class PrunedMistralForCausalLM(PerLayerHeads, MistralForCausalLM):
    config_class = PrunedMistralConfig


class PrunedQwen2Config(PerLayerConfig, Qwen2Config):
    model_type = "pruned_qwen2"


class PrunedQwen2Model(PerLayerHeads, Qwen2Model):
    config_class = PrunedQwen2Config


class PrunedQwen2ForCausalLM(PerLayerHeads, Qwen2ForCausalLM):
    config_class = PrunedQwen2Config


class PrunedQwen3Config(PerLayerConfig, Qwen3Config):
    model_type = "pruned_qwen3"


class PrunedQwen3Model(PerLayerHeads, Qwen3Model):
    config_class = PrunedQwen3Config


class PrunedQwen3ForCausalLM(PerLayerHeads, Qwen3ForCausalLM):
    config_class = PrunedQwen3Config


class PrunedGemma3TextConfig(PerLayerConfig, Gemma3TextConfig):
    model_type = "pruned_gemma3_text"


class PrunedGemma3TextModel(PerLayerHeads, Gemma3TextModel):
    config_class = PrunedGemma3TextConfig


class PrunedGemma3ForCausalLM(PerLayerHeads, Gemma3ForCausalLM):
    config_class = PrunedGemma3TextConfig
