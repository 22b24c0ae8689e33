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
values: pruning removes heads, never narrows them. Imports only transformers and
torch.
"""

from torch import nn
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
        if not (1 <= g <= h and h % g == 0):
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
        attn.num_key_value_groups = q // kv  # what the attention forward reads to repeat k/v


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
