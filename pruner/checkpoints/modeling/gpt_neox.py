"""GPT-NeoX (Pythia) with a different number of attention heads in each layer.

pruner (sink-aware attention-head pruning) writes this file next to the weights of
a GPT-NeoX whose attention heads were pruned. A vanilla GPT-NeoX config cannot
describe fewer heads: the head width is `hidden_size / num_attention_heads`, so
fewer heads would mean wider ones. The checkpoint is loaded with

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

(or, without running this file, `pruner.load(folder)`, which uses pruner's own
copy of it). Everything is the vanilla transformers model except each layer's
attention projections, built with that layer's head count from config.json:

    num_attention_heads_per_layer   heads kept in each layer

`num_attention_heads` keeps the base model's value, so the head width (and the
rotary width) stay what they were. Imports only transformers and torch.
"""

from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXModel

FORMAT = "per-layer-heads/1"


def check_head_counts(config) -> None:
    """Refuse per-layer head counts the layers cannot have (a hand-edited config.json)."""
    heads = config.num_attention_heads_per_layer
    if len(heads) != config.num_hidden_layers or not all(1 <= h <= config.num_attention_heads for h in heads):
        raise ValueError(f"config.json: num_attention_heads_per_layer {heads} needs one count per layer "
                         f"({config.num_hidden_layers}), each from 1 to num_attention_heads "
                         f"({config.num_attention_heads})")


def resize_attention(model, config) -> None:
    """Give each layer's attention the projections of its own head count (the weights load afterwards)."""
    d = config.hidden_size
    for layer, block in enumerate(model.base_model.layers):
        attn = block.attention
        width = config.num_attention_heads_per_layer[layer] * attn.head_size
        # per head [q_h, k_h, v_h]: the forward reshapes to (..., heads, 3 * head_size) with heads = -1
        attn.query_key_value = nn.Linear(d, 3 * width, bias=config.attention_bias)
        attn.dense = nn.Linear(width, d, bias=config.attention_bias)


class PerLayerHeads:
    """Mixin: resize the attention projections before transformers initialises and loads the weights."""

    def post_init(self):
        resize_attention(self, self.config)
        super().post_init()


class PrunedGPTNeoXConfig(GPTNeoXConfig):
    model_type = "pruned_gpt_neox"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_head_counts(self)


class PrunedGPTNeoXModel(PerLayerHeads, GPTNeoXModel):
    config_class = PrunedGPTNeoXConfig


class PrunedGPTNeoXForCausalLM(PerLayerHeads, GPTNeoXForCausalLM):
    config_class = PrunedGPTNeoXConfig
