"""BERT and RoBERTa with a different number of attention heads in each layer.

pruner (sink-aware attention-head pruning) writes this file next to the weights of
a BERT-style model whose attention heads were pruned. A vanilla BERT config cannot
describe fewer heads: the head width is `hidden_size / num_attention_heads`, so
fewer heads would mean wider ones. The checkpoint is loaded with

    AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)

(AutoModelForCausalLM for a decoder, AutoModel for the bare encoder; or, without
running this file, `pruner.load(folder)`, which uses pruner's own copy of it).
Everything is the vanilla transformers model except each layer's self-attention
projections, built with that layer's head count from config.json:

    num_attention_heads_per_layer   heads kept in each layer

`num_attention_heads` keeps the base model's value, so the head width stays
`hidden_size / num_attention_heads`. Imports only transformers and torch.
"""

from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertLMHeadModel,
    BertModel,
    RobertaConfig,
    RobertaForCausalLM,
    RobertaForMaskedLM,
    RobertaModel,
)

FORMAT = "per-layer-heads/1"


def check_head_counts(config) -> None:
    """Refuse per-layer head counts the layers cannot have (a hand-edited config.json)."""
    heads = config.num_attention_heads_per_layer
    if len(heads) != config.num_hidden_layers or not all(1 <= h <= config.num_attention_heads for h in heads):
        raise ValueError(f"config.json: num_attention_heads_per_layer {heads} needs one count per layer "
                         f"({config.num_hidden_layers}), each from 1 to num_attention_heads "
                         f"({config.num_attention_heads})")


def resize_attention(model, config) -> None:
    """Give each layer's self-attention the projections of its own head count (the weights load afterwards)."""
    d = config.hidden_size
    for layer, block in enumerate(model.base_model.encoder.layer):
        attn, out = block.attention.self, block.attention.output
        heads = config.num_attention_heads_per_layer[layer]
        width = heads * attn.attention_head_size
        attn.query, attn.key, attn.value = nn.Linear(d, width), nn.Linear(d, width), nn.Linear(d, width)
        attn.num_attention_heads, attn.all_head_size = heads, width
        out.dense = nn.Linear(width, d)


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


class PrunedBertConfig(PerLayerConfig, BertConfig):
    model_type = "pruned_bert"


class PrunedBertModel(PerLayerHeads, BertModel):
    config_class = PrunedBertConfig


class PrunedBertLMHeadModel(PerLayerHeads, BertLMHeadModel):
    config_class = PrunedBertConfig


class PrunedBertForMaskedLM(PerLayerHeads, BertForMaskedLM):
    config_class = PrunedBertConfig


class PrunedRobertaConfig(PerLayerConfig, RobertaConfig):
    model_type = "pruned_roberta"


class PrunedRobertaModel(PerLayerHeads, RobertaModel):
    config_class = PrunedRobertaConfig


class PrunedRobertaForCausalLM(PerLayerHeads, RobertaForCausalLM):
    config_class = PrunedRobertaConfig


class PrunedRobertaForMaskedLM(PerLayerHeads, RobertaForMaskedLM):
    config_class = PrunedRobertaConfig
