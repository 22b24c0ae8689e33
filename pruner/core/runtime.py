"""Running a model the same way everywhere: inputs on the right device, explicit positions, no KV cache,
and which kind of model (causal, masked LM) a config or a module describes."""

from __future__ import annotations

import functools
import inspect

import torch


def check_finite(model, name: str) -> None:
    """Refuse weights with NaN/inf: every statistic and score downstream would be silently NaN."""
    for pname, p in model.named_parameters():
        if p.device.type != "meta" and not torch.isfinite(p).all():
            raise ValueError(f"{name}: weight {pname} contains NaN or inf; the checkpoint is corrupt "
                             "(or was saved after a diverged training step)")


def is_causal(config) -> bool:
    """Whether a checkpoint is a causal LM (by its declared architecture or BERT's `is_decoder`)."""
    return bool(getattr(config, "is_decoder", False)) or any(
        a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))


def attends_causally(model) -> bool:
    """Whether the model's self-attention modules are causal (read off the modules themselves)."""
    return any(getattr(m, "is_causal", False) for m in model.modules() if hasattr(m, "layer_idx"))


def auto_class(config):
    """The vanilla Auto class that loads a checkpoint with its head: causal LM, masked LM, or bare encoder."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    if is_causal(config):
        return AutoModelForCausalLM
    if is_masked_lm(config):
        return AutoModelForMaskedLM  # keeps the MLM head: masked-token perplexity
    return AutoModel


def is_masked_lm(config) -> bool:
    return any(a.endswith("ForMaskedLM") for a in (config.architectures or []))


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted from the first real token, so left padding never shifts them. (B, T)"""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def model_bytes(model) -> int:
    """Bytes of a model's weights and buffers as it holds them."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def input_device(model) -> torch.device:
    """Where the inputs go: the embedding's device (the first device under a device_map)."""
    return model.get_input_embeddings().weight.device


@functools.lru_cache(maxsize=None)
def forward_parameters(cls) -> frozenset[str]:
    """The keyword arguments a model class's forward takes by name."""
    return frozenset(inspect.signature(cls.forward).parameters)


def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
    """One forward pass that is invariant to the padding side (explicit position ids), inputs moved to the model.

    No KV cache: these passes score whole windows (only recovery's text generation, which runs its
    own loop, decodes), and a cache would keep every layer's keys and values alive until the pass
    returns (GPT-2 small, 8 x 1024 tokens: 0.6 GiB).
    """
    device = input_device(model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    if "use_cache" in forward_parameters(type(model)):
        kwargs.setdefault("use_cache", False)
    return model(input_ids=input_ids, attention_mask=attention_mask,
                 position_ids=position_ids(attention_mask), **kwargs)


