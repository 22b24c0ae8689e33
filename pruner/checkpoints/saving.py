"""Writing a pruned model in its layout and storage dtype, then proving the files hold it.

Nothing is published that does not load: `save` writes, reloads by every route a user
has (transformers, and `pruner.checkpoints.loading.load` for per-layer checkpoints), and
requires the logits to match the in-memory model within 1e-5 and greedy generation with
the KV cache to give the same tokens.

Storage dtype: a checkpoint is stored in the base checkpoint's own dtype unless asked
otherwise (the shipped models keep float16 weights). The in-memory model is usually
float32, so the check compares the reload with the in-memory model *rounded to the
storage dtype* (computed in the in-memory dtype): that proves the file holds exactly
the model it should, to 1e-5. What the rounding itself costs is a separate, measured
number (`Saved.storage_diff`, max |logit change| vs the unrounded model), reported in
the model card, not hidden inside a loose tolerance.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from pruner.checkpoints import layout as forms
from pruner.checkpoints import loading, modeling
from pruner.checkpoints.storage import CheckpointError, rounded_to, stored_as
from pruner.core import runtime

ATOL = 1e-5
CHECK_TOKENS = 16       # (2, CHECK_TOKENS) random ids for the logit check
GENERATE_TOKENS = 8     # greedy tokens generated with the KV cache from the first 8 of them
# --- writing and checking --------------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    """What `save` wrote and what its reload check measured."""

    layout: str                 # dense | vanilla | per-layer
    why_per_layer: str | None   # why no vanilla config describes it (per-layer only)
    dtype: str                  # storage dtype
    max_diff: float             # max |logit difference|, reload vs in-memory model rounded to `dtype`
    storage_diff: float         # max |logit difference| that rounding to `dtype` itself makes
    generation: bool | None     # greedy generation with the KV cache identical (None: not a causal LM)
    loaded_with: tuple[str, ...]  # the routes the check reloaded it by
    note: str | None = None     # a vanilla checkpoint written as another family's class: why (layout.SERVED_AS)


def save(model, tokenizer, folder: Path, removed: bool, dtype: str | None = None) -> Saved:
    """Write `model` (+ tokenizer) to `folder` in its layout and storage dtype, then prove it reloads.

    `removed`: heads were physically removed (a compact checkpoint) rather than masked (dense).
    `dtype`: storage dtype (None: the model's own). Raises CheckpointError when no layout
    holds the model or the reload does not reproduce it.
    """
    already = getattr(model.config, modeling.FORMAT_KEY, None)  # a per-layer model itself (pruner.load of one)
    kind, why = ("per-layer", "it is a per-layer model (layers keep different head counts)") if already else \
        forms.layout(model, removed)
    folder, note = Path(folder), None
    own = next(model.parameters()).dtype
    store = getattr(torch, dtype) if dtype else own
    with stored_as(model, store):
        if kind == "per-layer":
            (model if already else forms.per_layer_model(model)).save_pretrained(folder)
            family = modeling.vanilla_type(model.config.model_type) if already else model.config.model_type
            shutil.copyfile(modeling.source(family), folder / modeling.file_name(family))
        else:
            form = forms.vanilla_form(model) if kind == "vanilla" else None
            note = form.note if form is not None else None
            (forms.vanilla_model(model, form) if form is not None else model).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    max_diff, storage_diff, generation, routes = verify(model, folder, kind, store)
    return Saved(kind, why, str(store).removeprefix("torch."), max_diff, storage_diff, generation, routes, note)


def check_ids(model) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (2, CHECK_TOKENS), generator=torch.Generator().manual_seed(0))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = runtime.forward(model, ids, torch.ones_like(ids))
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float().cpu()


def greedy(model, ids: torch.Tensor, new_tokens: int = GENERATE_TOKENS) -> torch.Tensor:
    """Greedy tokens with the KV cache (the cache is where removed KV heads save memory). (B, T + new)"""
    prompt = ids.to(runtime.input_device(model))
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (model.config.eos_token_id or 0)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, num_beams=1,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True,
                             pad_token_id=pad if isinstance(pad, int) else pad[0])
    return out.cpu()


def _reloaders(model, folder: Path, kind: str):
    """(name, loader) for every route a user has to this checkpoint, in the in-memory model's dtype."""
    dtype = next(model.parameters()).dtype
    kw = {"device_map": model.hf_device_map} if getattr(model, "hf_device_map", None) else {}
    cls = runtime.auto_class(SimpleNamespace(**loading.read_config(folder)))  # the Auto class its config.json names
    if kind == "per-layer":
        return [(f"transformers {cls.__name__}, trust_remote_code=True",
                 lambda: cls.from_pretrained(folder, dtype=dtype, trust_remote_code=True, **kw)),
                ("pruner.load", lambda: loading.load(folder, dtype=str(dtype).removeprefix("torch."), **kw))]
    return [(f"transformers {cls.__name__}", lambda: cls.from_pretrained(folder, dtype=dtype, **kw))]


def verify(model, folder: Path, kind: str, store: torch.dtype) -> tuple[float, float, bool | None, tuple[str, ...]]:
    """Reload `folder` by every route and compare with `model` rounded to `store`.

    Returns (max logit diff over routes, logit change the rounding itself makes, greedy
    generation identical or None, routes). Raises CheckpointError on a mismatch.
    """
    device = runtime.input_device(model)
    ids = check_ids(model).to(device)
    causal = runtime.is_causal(SimpleNamespace(**loading.read_config(folder)))  # as written (tiny models lack architectures)
    exact = logits(model, ids)
    with rounded_to(model, store):
        want = logits(model, ids)
        tokens = greedy(model, ids[:, :8]) if causal else None
    storage_diff = (want - exact).abs().max().item()
    worst, routes = 0.0, []
    for name, reload in _reloaders(model, folder, kind):
        reloaded = reload()
        if not getattr(model, "hf_device_map", None):
            reloaded = reloaded.to(device)
        reloaded.eval()
        diff = (logits(reloaded, ids) - want).abs().max().item()
        if not diff <= ATOL:
            raise CheckpointError(f"the written checkpoint reloads ({name}) with logits off by {diff:.2e} "
                                  f"(more than {ATOL:g}); nothing was published")
        if causal and not torch.equal(greedy(reloaded, ids[:, :8]), tokens):
            raise CheckpointError(f"the written checkpoint reloads ({name}) with different greedy generations "
                                  "(KV cache); nothing was published")
        worst = max(worst, diff)
        routes.append(name)
        del reloaded
    return worst, storage_diff, (True if causal else None), tuple(routes)


# --- loading ---------------------------------------------------------------------------------


