"""Checkpoints of a pruned model: which form holds it, writing it in its storage dtype, loading it back.

Three layouts, chosen by `layout` (never by the user guessing):

- `dense`     -- pruned heads zeroed, every shape the base model's: a vanilla checkpoint.
- `vanilla`   -- heads physically removed, described by the family's own config: the
                 same head count in every layer, a family whose attention reads an
                 explicit `head_dim` (Llama, Mistral, Qwen2, Qwen3; a Qwen2 config gets
                 the key written), and a config transformers' validation accepts.
- `per-layer` -- heads removed where no vanilla config can say it (counts differ
                 between layers; GPT-2, BERT and GPT-NeoX, whose head width is
                 hidden / heads; a head count the config rejects; an output-projection
                 bias the config cannot declare): config.json carries `pruner_format`
                 and per-layer counts, and `auto_map` points at a copy of pruner's
                 packaged modeling file (pruner/modeling), so
                 `from_pretrained(folder, trust_remote_code=True)` loads it and
                 `load(folder)` loads it with pruner's own copy instead.

Nothing is published that does not load: `save` writes, reloads by every route a user
has (transformers, and `load` for per-layer checkpoints), and requires the logits to
match the in-memory model within 1e-5 and greedy generation with the KV cache to give
the same tokens.

Storage dtype: a checkpoint is stored in the base checkpoint's own dtype unless asked
otherwise (the shipped models keep float16 weights). The in-memory model is usually
float32, so the check compares the reload with the in-memory model *rounded to the
storage dtype* (computed in the in-memory dtype): that proves the file holds exactly
the model it should, to 1e-5. What the rounding itself costs is a separate, measured
number (`Saved.storage_diff`, max |logit change| vs the unrounded model), reported in
the model card, not hidden inside a loose tolerance.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch

from pruner import arch, modeling, models, surgery

LAYOUTS = ("dense", "vanilla", "per-layer")
DTYPES = ("float32", "float16", "bfloat16")
ATOL = 1e-5
CHECK_TOKENS = 16       # (2, CHECK_TOKENS) random ids for the logit check
GENERATE_TOKENS = 8     # greedy tokens generated with the KV cache from the first 8 of them
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, would not reload, or does not match its config."""


# --- which layout ----------------------------------------------------------------------------


def bias_not_in_config(model) -> bool:
    """Mean compensation gave an output projection a bias the vanilla config cannot declare (Mistral, Qwen2)."""
    return bool(getattr(model, "_pruner_bias_not_in_config", False))


def removed_any(model) -> bool:
    g = arch.geometry(model)
    return any(len(v) < g.n_heads for v in surgery.kept_heads(model).values())


def head_counts(model) -> tuple[list[int], list[int]]:
    """Query and key/value heads present in each layer."""
    g = arch.geometry(model)
    kept = surgery.kept_heads(model)
    q = [len(kept[layer]) for layer in range(g.n_layers)]
    kv = [len({h // g.group_size for h in kept[layer]}) for layer in range(g.n_layers)]
    return q, kv


def _counts_text(model) -> str:
    q, kv = head_counts(model)
    g = arch.geometry(model)
    gqa = g.group_size > 1
    return ", ".join(f"layer {i}: {a}" + (f"/{b} kv" if gqa else "") for i, (a, b) in enumerate(zip(q, kv)))


def _vanilla_updates(model) -> dict:
    """The config keys a vanilla config needs to describe the compact model (uniform counts assumed)."""
    g = arch.geometry(model)
    q, kv = head_counts(model)
    updates = {"head_dim": g.head_dim, "num_attention_heads": q[0]}
    if hasattr(model.config, "num_key_value_heads"):
        updates["num_key_value_heads"] = kv[0]
    return updates


def vanilla_reason(model) -> str | None:
    """Why no vanilla config describes this compact (heads removed) model, or None when one does."""
    kind = model.config.model_type
    if bias_not_in_config(model):
        return f"its output projections have a bias (mean compensation) that the {kind} config cannot declare"
    if not removed_any(model):
        return None
    if not arch.adapter_for(model).explicit_head_dim:
        return (f"the {kind} config derives the head width from hidden_size / heads, so it cannot describe "
                "fewer heads of the same width")
    q, kv = head_counts(model)
    if len(set(q)) != 1 or len(set(kv)) != 1:
        return f"its head counts differ between layers ({_counts_text(model)})"
    try:  # transformers validates configs on save (e.g. Llama's hidden_size % num_attention_heads)
        type(model.config).from_dict({**model.config.to_dict(), **_vanilla_updates(model)})
    except Exception as e:  # noqa: BLE001 - any validation failure means "not expressible"
        why = str(e.__cause__ or e).strip().splitlines()[-1].strip().rstrip(".")  # strict validation wraps the cause
        return f"transformers rejects a {kind} config with {q[0]} heads: {why}"
    return None


def layout(model, removed: bool) -> tuple[str, str | None]:
    """(`dense` | `vanilla` | `per-layer`, why not vanilla). `removed`: the heads are physically gone."""
    if not removed:
        if bias_not_in_config(model):
            raise CheckpointError(
                f"cannot write a dense checkpoint: {vanilla_reason(model)}. Export the compact form instead "
                "(`--format compact`: it declares that bias and loads with trust_remote_code=True or "
                "pruner.load), or re-run `pruner prune` with `--set surgery.compensation=refit` (plain weights, "
                "no bias) or `zero`")
        return "dense", None
    reason = vanilla_reason(model)
    return ("vanilla", None) if reason is None else ("per-layer", reason)


# --- the per-layer form ----------------------------------------------------------------------


def per_layer_config(model):
    """The packaged per-layer config of an in-memory compact model (base counts + one count per layer)."""
    cfg, g = model.config, arch.geometry(model)
    kind = cfg.model_type
    q, kv = head_counts(model)
    d = cfg.to_dict()
    d.pop("model_type", None)
    d[cfg.attribute_map.get("num_attention_heads", "num_attention_heads")] = g.n_heads
    d["num_attention_heads_per_layer"] = q
    if hasattr(cfg, "num_key_value_heads"):
        d.update(num_key_value_heads=g.n_kv_heads, num_key_value_heads_per_layer=kv, head_dim=g.head_dim)
    if bias_not_in_config(model):
        ad = arch.adapter_for(model)
        d["o_proj_bias_per_layer"] = [arch.get(b, ad.o_proj).bias is not None for b in arch.blocks(model)]
    d[modeling.FORMAT_KEY] = modeling.FORMAT
    d["auto_map"] = modeling.auto_map(kind, [type(model).__name__, type(model.base_model).__name__],
                                      type(cfg).__name__)
    return modeling.per_layer_class(kind, type(cfg).__name__).from_dict(d)


def per_layer_model(model):
    """The in-memory compact model as pruner's packaged per-layer class, sharing its tensors (no copy)."""
    config = per_layer_config(model)
    cls = modeling.per_layer_class(model.config.model_type, type(model).__name__)
    with torch.device("meta"):
        new = cls(config)
    state = model.state_dict()
    try:
        new.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # the packaged class and the surgery disagree: a pruner bug, say where
        raise CheckpointError(f"the per-layer {cls.__name__} does not fit the pruned weights: "
                              f"{' '.join(str(e).split())[:400]}") from None
    buffers = dict(model.named_buffers())
    for name, _ in list(new.named_buffers()):  # non-persistent buffers (rotary frequencies) are not in state
        owner, _, leaf = name.rpartition(".")
        setattr(arch.get(new, owner) if owner else new, leaf, buffers[name])
    if getattr(model, "generation_config", None) is not None:
        new.generation_config = model.generation_config
    return new.eval()


# --- storage dtype ---------------------------------------------------------------------------


def _headers(files: list[Path]) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", ...} from safetensors headers (no tensor is read)."""
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        out.update({k: v for k, v in header.items() if k != "__metadata__"})
    return out


def _safetensors_dtypes(files: list[Path]) -> dict[str, int]:
    """Element count per floating dtype over the tensors of safetensors files."""
    counts: dict[str, int] = {}
    for t in _headers(files).values():
        if t["dtype"] in _SAFETENSORS_DTYPES:
            name = _SAFETENSORS_DTYPES[t["dtype"]]
            counts[name] = counts.get(name, 0) + math.prod(t["shape"])
    return counts


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (sharded or not); empty when it has none."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / "model.safetensors"] if (folder / "model.safetensors").exists() else []


def storage_dtype(spec) -> str | None:
    """The dtype the base checkpoint of a recipe's `model` section stores its weights in.

    Read from the safetensors headers (the shipped checkpoints say float32 in config.json
    but hold float16 weights), else config.json's dtype. A Hub id is read from the local
    cache. None when no checkpoint can be found (a model built in memory): keep the model's.
    """
    try:
        path = models.resolve("minilm" if spec.mlm_readout else spec.path)
    except OSError:
        return None
    folder = Path(path)
    if not folder.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            folder = Path(cached).parent if isinstance(cached, str) else folder
        except Exception:  # noqa: BLE001 - not an id the cache knows
            return None
    counts = _safetensors_dtypes(weight_files(folder)) if folder.exists() else {}
    if counts:
        return max(counts, key=counts.get)
    config = folder / "config.json"
    if config.exists():
        d = json.loads(config.read_text())
        declared = d.get("dtype") or d.get("torch_dtype")
        if declared in DTYPES:
            return declared
    return None


@contextmanager
def _params_as(model, convert) -> Iterator[None]:
    """Every floating parameter temporarily replaced by `convert(tensor)` (restored on exit)."""
    saved = []
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                saved.append((p, p.data))
                p.data = convert(p.data)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def stored_as(model, dtype: torch.dtype):
    """`with stored_as(model, float16):` the parameters are what a float16 file holds (for saving)."""
    return _params_as(model, lambda t: t.to(dtype))


def rounded_to(model, dtype: torch.dtype):
    """`with rounded_to(model, float16):` the parameters are rounded to float16, kept in their own dtype:
    the model a float16 checkpoint reloads as."""
    return _params_as(model, lambda t: t.to(dtype).to(t.dtype))


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


def save(model, tokenizer, folder: Path, removed: bool, dtype: str | None = None) -> Saved:
    """Write `model` (+ tokenizer) to `folder` in its layout and storage dtype, then prove it reloads.

    `removed`: heads were physically removed (a compact checkpoint) rather than masked (dense).
    `dtype`: storage dtype (None: the model's own). Raises CheckpointError when no layout
    holds the model or the reload does not reproduce it.
    """
    kind, why = layout(model, removed)
    folder = Path(folder)
    own = next(model.parameters()).dtype
    store = getattr(torch, dtype) if dtype else own
    with stored_as(model, store):
        if kind == "per-layer":
            per_layer_model(model).save_pretrained(folder)
            family = model.config.model_type
            shutil.copyfile(modeling.source(family), folder / modeling.file_name(family))
        else:
            if kind == "vanilla" and removed_any(model):
                for key, value in _vanilla_updates(model).items():  # Qwen2 gets an explicit head_dim here
                    setattr(model.config, key, value)
            model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    max_diff, storage_diff, generation, routes = verify(model, folder, kind, store)
    return Saved(kind, why, str(store).removeprefix("torch."), max_diff, storage_diff, generation, routes)


def _check_ids(model) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (2, CHECK_TOKENS), generator=torch.Generator().manual_seed(0))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = models.forward(model, ids, torch.ones_like(ids))
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float().cpu()


def greedy(model, ids: torch.Tensor, new_tokens: int = GENERATE_TOKENS) -> torch.Tensor:
    """Greedy tokens with the KV cache (the cache is where removed KV heads save memory). (B, T + new)"""
    prompt = ids.to(models.input_device(model))
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
    cls = models.auto_class(SimpleNamespace(**read_config(folder)))  # the Auto class its config.json names
    if kind == "per-layer":
        return [(f"transformers {cls.__name__}, trust_remote_code=True",
                 lambda: cls.from_pretrained(folder, dtype=dtype, trust_remote_code=True, **kw)),
                ("pruner.load", lambda: load(folder, dtype=str(dtype).removeprefix("torch."), **kw))]
    return [(f"transformers {cls.__name__}", lambda: cls.from_pretrained(folder, dtype=dtype, **kw))]


def verify(model, folder: Path, kind: str, store: torch.dtype) -> tuple[float, float, bool | None, tuple[str, ...]]:
    """Reload `folder` by every route and compare with `model` rounded to `store`.

    Returns (max logit diff over routes, logit change the rounding itself makes, greedy
    generation identical or None, routes). Raises CheckpointError on a mismatch.
    """
    device = models.input_device(model)
    ids = _check_ids(model).to(device)
    causal = models.is_causal(SimpleNamespace(**read_config(folder)))  # as written (tiny models lack architectures)
    exact = _logits(model, ids)
    with rounded_to(model, store):
        want = _logits(model, ids)
        tokens = greedy(model, ids[:, :8]) if causal else None
    storage_diff = (want - exact).abs().max().item()
    worst, routes = 0.0, []
    for name, reload in _reloaders(model, folder, kind):
        reloaded = reload()
        if not getattr(model, "hf_device_map", None):
            reloaded = reloaded.to(device)
        reloaded.eval()
        diff = (_logits(reloaded, ids) - want).abs().max().item()
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


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint folder or shipped name, as a dict (no class, no remote code)."""
    from transformers import PreTrainedConfig

    d, _ = PreTrainedConfig.get_config_dict(models.resolve(str(path)))
    return d


def is_per_layer(config: dict) -> bool:
    return modeling.FORMAT_KEY in config


def check_weights(build, folder: Path) -> None:
    """Refuse, in one line, a config whose head counts do not match the weights (an edited config.json).

    The model is built on the meta device (no memory) and each tensor's shape compared
    with the safetensors headers; only the attention projections can disagree here.
    """
    files = weight_files(folder)
    if not files:
        return
    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # noqa: BLE001 - a config the meta build cannot take: the load itself will say what is wrong
        return
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    stored = {k: tuple(v["shape"]) for k, v in _headers(files).items()}
    prefix = f"{model.base_model_prefix}."
    for key, shape in stored.items():
        want = expected.get(key, expected.get(key.removeprefix(prefix)))
        if want is not None and want != shape:
            raise CheckpointError(
                f"{folder}: config.json does not match the weights: {key} is {list(shape)} in the checkpoint but "
                f"{list(want)} by the config's head counts (was config.json edited, or copied from another "
                "checkpoint?)")


def _per_layer_class(path, d: dict):
    """pruner's packaged class for a per-layer checkpoint's config.json (format version checked)."""
    version = d[modeling.FORMAT_KEY]
    if version != modeling.FORMAT:
        raise modeling.FormatError(f"{path}: per-layer format {version!r} is not one this pruner reads "
                                   f"({modeling.FORMAT}); upgrade pruner")
    kind = modeling.vanilla_type(d.get("model_type", ""))
    return modeling.per_layer_class(kind, (d.get("architectures") or [""])[0].removeprefix(modeling.PREFIX))


def load_config(path: str | Path):
    """A per-layer checkpoint's config as pruner's packaged config class (no remote code)."""
    folder = models.resolve(str(path))
    return _per_layer_class(path, read_config(folder)).config_class.from_pretrained(folder)


def load(path: str | Path, dtype: str | None = None, device: str | None = None, **kwargs):
    """Load a checkpoint pruner wrote -- per-layer, vanilla compact or dense -- without remote code.

    Per-layer checkpoints are built with pruner's packaged classes (pruner/modeling), never
    with the modeling file in the folder; vanilla ones with transformers' Auto class.
    `kwargs` go to `from_pretrained` (e.g. `device_map`, `attn_implementation`).
    Returns the model in eval mode.
    """
    from transformers import AutoConfig

    folder = models.resolve(str(path))
    d = read_config(folder)
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if is_per_layer(d):
        cls = _per_layer_class(path, d)
        config = cls.config_class.from_pretrained(folder)
        build = lambda: cls(config)  # noqa: E731
    else:
        if "auto_map" in d:
            raise CheckpointError(f"{path} needs its own modeling code (auto_map) and is not a pruner per-layer "
                                  "checkpoint; load it with transformers and trust_remote_code=True if you trust it")
        config = AutoConfig.from_pretrained(folder)
        cls = models.auto_class(config)
        build = lambda: cls.from_config(config)  # noqa: E731
    if Path(folder).exists():
        check_weights(build, Path(folder))
    model = cls.from_pretrained(folder, config=config, **kwargs)
    if device and not kwargs.get("device_map"):
        model = model.to(device)
    return model.eval()
