"""GPT-2 with a different number of attention heads in each layer.

pruner (sink-aware attention-head pruning) writes this file next to the weights of
a GPT-2 whose attention heads were pruned. A vanilla GPT-2 config cannot describe
fewer heads: the head width is `n_embd / n_head`, so fewer heads would mean wider
ones. The checkpoint is loaded with

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

(or, without running this file, `pruner.load(folder)`, which uses pruner's own
copy of it). Everything is the vanilla transformers model except each layer's
attention projections, built with that layer's head count from config.json:

    num_attention_heads_per_layer   heads kept in each layer

`n_head` keeps the base model's value, so the head width stays `n_embd / n_head`.
Imports only transformers and torch.
"""

from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model
from transformers.pytorch_utils import Conv1D

FORMAT = "per-layer-heads/1"


def check_head_counts(config) -> None:
    """Refuse per-layer head counts the layers cannot have (a hand-edited config.json)."""
    heads = config.num_attention_heads_per_layer
    if len(heads) != config.num_hidden_layers or not all(1 <= h <= config.num_attention_heads for h in heads):
        raise ValueError(f"config.json: num_attention_heads_per_layer {heads} needs one count per layer "
                         f"({config.num_hidden_layers}), each from 1 to n_head ({config.num_attention_heads})")


def resize_attention(model, config) -> None:
    """Give each layer's attention the projections of its own head count (the weights load afterwards)."""
    for layer, block in enumerate(model.base_model.h):
        attn = block.attn
        width = config.num_attention_heads_per_layer[layer] * attn.head_dim
        attn.c_attn = Conv1D(3 * width, attn.embed_dim)  # [q | k | v], each `width` wide
        attn.c_proj = Conv1D(attn.embed_dim, width)
        attn.num_heads = config.num_attention_heads_per_layer[layer]
        attn.split_size = width  # what the attention forward splits c_attn's output by


class PerLayerHeads:
    """Mixin: resize the attention projections before transformers initialises and loads the weights."""

    def post_init(self):
        resize_attention(self, self.config)
        super().post_init()


class PrunedGPT2Config(GPT2Config):
    model_type = "pruned_gpt2"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_head_counts(self)


class PrunedGPT2Model(PerLayerHeads, GPT2Model):
    config_class = PrunedGPT2Config


class PrunedGPT2LMHeadModel(PerLayerHeads, GPT2LMHeadModel):
    config_class = PrunedGPT2Config
