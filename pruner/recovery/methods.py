"""What recovery trains: every kept weight (`full`), every weight of the transformer blocks (`blocks`), LoRA adapters
merged at the end (`lora`), or the kept heads' projections alone (`attention`).

`blocks` leaves the embeddings, the final norm and the LM head as the base has them: pruning never touched them,
and under AdamW every vocabulary row moves on every step (each gets a gradient through the softmax), however
rarely its token occurs in the recovery text, which a large tied vocabulary (Gemma 3: 262,144 rows, 62% of the
weights) might pay for on other text. Measured on Gemma, freezing them did not help (docs/evidence/gemma.md): the
recovery text mattered, not the vocabulary. The architecture adapters say where attention lives; PEFT does LoRA.

A student in the dense form (`surgery.mode: mask`) keeps its pruned heads as zero columns
of the output projection: `keep_pruned_zero` puts them back to zero after every step, and
LoRA leaves the output projection alone there, so recovery never brings a pruned head back.
"""

from __future__ import annotations

import torch

from pruner.core import arch


def _block_names(model) -> list[str]:
    """The transformer blocks' module names in `model` (wherever the base model sits under it)."""
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(b)] for b in arch.blocks(model)]


def _projections(model) -> list[str]:
    """Names of the linear (and GPT-2 Conv1D) modules inside the transformer blocks."""
    blocks = tuple(f"{b}." for b in _block_names(model))
    return [name for name, m in model.named_modules()
            if name.startswith(blocks) and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")]


def _attention_prefixes(model) -> list[str]:
    """Module name prefixes of each block's attention projections (q, k, v or fused qkv, and the output)."""
    ad = arch.names_adapter(model)  # a per-layer student's names too
    own = [p for p in (ad.q, ad.k, ad.v, ad.qkv, ad.o_proj) if p]
    return [f"{b}.{p}." for b in _block_names(model) for p in own]


def trained_prefixes(model, method: str) -> tuple[str, ...] | None:
    """Name prefixes of the parameters `method` trains (None: every parameter; not for lora)."""
    if method == "attention":
        return tuple(_attention_prefixes(model))
    if method == "blocks":
        return tuple(f"{b}." for b in _block_names(model))
    return None


def prepare(model, method: str, dense_heads: dict[int, list[int]] | None = None, rank: int = 8,
            alpha: float = 16.0, seed: int = 0):
    """The model to train (PEFT-wrapped for lora) with `requires_grad` set as `method` says. float32.

    LoRA's A matrices start random: drawn from `seed` (the caller's random stream untouched), so that every
    process of a multi-process recovery starts from the same adapters and a recovery is the same run however many
    processes it had or whatever ran before it."""
    model.float()
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = _projections(model)
        if dense_heads:  # the output projection holds the pruned heads' zero columns: not adapted
            o = {f"{b}.{arch.names_adapter(model).o_proj}" for b in _block_names(model)}
            targets = [t for t in targets if t not in o]
        fan_in_fan_out = any(type(m).__name__ == "Conv1D" for m in model.modules())
        cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets,
                         fan_in_fan_out=fan_in_fan_out, bias="none")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return get_peft_model(model, cfg)
    allowed = trained_prefixes(model, method)
    for name, p in model.named_parameters():
        p.requires_grad_(allowed is None or name.startswith(allowed))
    return model


def finish(model, method: str):
    """The plain model back: LoRA merged into the weights (a checkpoint with no adapters)."""
    if method == "lora":
        model = model.merge_and_unload()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def trainable(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def keep_pruned_zero(model, dense_heads: dict[int, list[int]] | None) -> None:
    """Zero the pruned heads' output-projection columns again (dense students only; a no-op otherwise)."""
    if not dense_heads:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hd = arch.geometry(base).head_dim
    for layer, heads in dense_heads.items():
        cols = arch.o_weight_cols(base, layer)  # (d_model, heads * d_head)
        for h in heads:
            cols[:, h * hd:(h + 1) * hd] = 0


@torch.no_grad()
def zero_heads(model) -> dict[int, list[int]] | None:
    """The heads a dense (masked) model holds as all-zero output-projection columns: its pruned heads, read from
    the weights when no plan is at hand (`pruner.recover` on a model object). None when there are none (and for
    a per-layer model, compact by construction)."""
    if arch.is_per_layer(model):
        return None
    hd = arch.geometry(model).head_dim
    found = {}
    for layer in range(len(arch.blocks(model))):
        cols = arch.o_weight_cols(model, layer)  # (d_model, heads * d_head)
        zero = [h for h in range(cols.shape[1] // hd) if not cols[:, h * hd:(h + 1) * hd].any()]
        if zero:
            found[layer] = zero
    return found or None
