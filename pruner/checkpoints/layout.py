"""Which form holds a pruned model, and the per-layer form where no vanilla config can say it.

Three layouts, chosen by `layout` (never by the user guessing):

- `dense`     -- pruned heads zeroed, every shape the base model's: a vanilla checkpoint.
- `vanilla`   -- heads physically removed, described by a vanilla config: the same head
                 count in every layer, a family whose attention reads an explicit
                 `head_dim` (Llama, Mistral, Qwen2, Qwen3; a Qwen2 config gets the key
                 written), and a config transformers' validation accepts. A Llama whose
                 own config refuses the count (`hidden_size % num_attention_heads`) is
                 written as `MistralForCausalLM` (`SERVED_AS`): with no sliding window and
                 no biases it is the same function, and Mistral takes any `head_dim`.
- `per-layer` -- heads removed where no vanilla config can say it (counts differ
                 between layers; GPT-2, BERT and GPT-NeoX, whose head width is
                 hidden / heads; a head count the config rejects; an output-projection
                 bias the config cannot declare): config.json carries `pruner_format`
                 and per-layer counts, and `auto_map` points at a copy of pruner's
                 packaged modeling file (`pruner.checkpoints.modeling`), so
                 `from_pretrained(folder, trust_remote_code=True)` loads it and
                 `pruner.load(folder)` loads it with pruner's own copy instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pruner.checkpoints import modeling
from pruner.checkpoints.storage import CheckpointError
from pruner.core import arch
from pruner.pruning import surgery

LAYOUTS = ("dense", "vanilla", "per-layer")
# family -> the vanilla family that computes the same function with an explicit head_dim and no divisibility check
# (Llama's config checks hidden_size % num_attention_heads; Mistral's does not: Mistral-NeMo ships hidden 5120 with
# 32 heads of 128). Keys a Mistral config has no use for are dropped; the biases it cannot declare are refused.
SERVED_AS = {"llama": ("mistral", "MistralConfig", "MistralForCausalLM")}
# families whose every uniform head count llama.cpp runs from GGUF (its gemma3 architecture takes any count), also
# where transformers' config refuses it (Gemma 3: hidden_size % heads): servable shapes, written in the per-layer form
GGUF_UNIFORM = {"gemma3_text": "llama.cpp's gemma3"}
_NOT_CARRIED = ("attention_bias", "mlp_bias", "pretraining_tp", "model_type", "architectures", "head_dim")


@dataclass(frozen=True)
class Vanilla:
    """The vanilla checkpoint that holds a compact model."""

    config: object           # the config.json to write
    architecture: str | None  # the class it names when not the model's own (MistralForCausalLM), else None
    note: str | None          # why the class changed (model card, export output); None when it did not


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


def vanilla_updates(model) -> dict:
    """The config keys a vanilla config needs to describe the compact model (uniform counts assumed)."""
    g = arch.geometry(model)
    q, kv = head_counts(model)
    updates = {"head_dim": g.head_dim, "num_attention_heads": q[0]}
    if hasattr(model.config, "num_key_value_heads"):
        updates["num_key_value_heads"] = kv[0]
    return updates


def servable_prunes(model, gqa: str = "equal") -> tuple[int, ...] | None:
    """Heads per layer a layer can lose while a vanilla config describes the compact model (the same count in
    every layer); None for families whose config derives the head width from hidden_size / heads (GPT-2, BERT,
    GPT-NeoX: no pruned config of theirs is vanilla).

    `gqa` "equal" keeps every KV head (the same number of query heads left in each group), "group" removes
    whole KV groups. Each count is checked by the family's own config validation, or for Llama, whose config
    requires hidden_size % heads == 0, by Mistral's (`SERVED_AS`): every multiple of the KV heads is servable.
    Gemma 3 keeps the counts its config refuses too (`GGUF_UNIFORM`): llama.cpp serves them from GGUF.
    """
    if not arch.adapter_for(model).explicit_head_dim:
        return None
    g = arch.geometry(model)
    kept = [(q, g.n_kv_heads) for q in range(g.n_kv_heads, g.n_heads + 1, g.n_kv_heads)] if gqa == "equal" else \
        [(kv * g.group_size, kv) for kv in range(1, g.n_kv_heads + 1)]
    out = []
    for q, kv in kept:
        counts = {"num_attention_heads": q, "num_key_value_heads": kv, "head_dim": g.head_dim}
        if isinstance(_config_for(model.config, counts), str) and model.config.model_type not in GGUF_UNIFORM:
            continue
        out.append(g.n_heads - q)
    return tuple(sorted(out))


def _config_for(cfg, counts: dict):
    """A vanilla config with `counts` (head keys): the family's own, else its `SERVED_AS` family's; or why none."""
    try:  # transformers validates configs on save (e.g. Llama's hidden_size % num_attention_heads)
        return type(cfg).from_dict({**cfg.to_dict(), **counts})
    except Exception as e:  # noqa: BLE001 - any validation failure means "not expressible"
        why = str(e.__cause__ or e).strip().splitlines()[-1].strip().rstrip(".")  # strict validation wraps the cause
        refused = f"transformers rejects a {cfg.model_type} config with {counts['num_attention_heads']} heads: {why}"
    if cfg.model_type not in SERVED_AS:
        return refused
    family, config_class, model_class = SERVED_AS[cfg.model_type]
    biases = [k for k in ("attention_bias", "mlp_bias") if getattr(cfg, k, False)]
    if biases:
        return (f"{refused}; {model_class}, which takes any head count, has no {' or '.join(biases)} "
                "(the mean compensation this run was given puts biases on the attention projections: refit, the "
                "default when surgery.compensation is unset, or zero writes a vanilla one)")
    import transformers

    d = {k: v for k, v in cfg.to_dict().items() if k not in _NOT_CARRIED}
    try:
        return getattr(transformers, config_class).from_dict({**d, **counts, "sliding_window": None})
    except Exception as e:  # noqa: BLE001 - e.g. rope parameters the other family does not take
        return f"{refused}; nor does {config_class} hold it: {str(e.__cause__ or e).strip().splitlines()[-1]}"


def mean_refusal(model, heads: dict[int, list[int]], removed: bool) -> str | None:
    """Why mean compensation's output-projection bias would keep pruning `heads` out of a vanilla checkpoint that
    refit (plain weights) gets; None where the form written would hold it, or would be per-layer anyway.

    Read on the unpruned model, before any surgery: a run whose recipe left `surgery.compensation` unset says
    with it why it used refit.
    """
    ad, cfg = arch.adapter_for(model), model.config
    kind = cfg.model_type
    if arch.get(arch.blocks(model)[0], ad.o_proj).bias is not None:
        return None  # folded into the bias the family has (GPT-2, BERT, GPT-NeoX)
    if ad.bias_flag is None or not hasattr(cfg, ad.bias_flag):
        return f"the {kind} config cannot declare it: " + ("the per-layer form" if removed else "no dense checkpoint")
    g = arch.geometry(model)
    kept = [[h for h in range(g.n_heads) if h not in heads.get(layer, ())] for layer in range(g.n_layers)]
    q, kv = {len(k) for k in kept}, {len({h // g.group_size for h in k}) for k in kept}
    if not removed or q == {g.n_heads} or len(q) > 1 or len(kv) > 1 or not ad.explicit_head_dim:
        return None  # dense (the config's bias switch holds it), or the per-layer form whatever the compensation
    config = _config_for(cfg, {"num_attention_heads": q.pop(), "num_key_value_heads": kv.pop(),
                               "head_dim": g.head_dim})
    if isinstance(config, str) or type(config) is type(cfg):
        return None
    return f"the {SERVED_AS[kind][2]} this {kind} is written as has no {ad.bias_flag}: the per-layer form"


def _bias_reason(kind: str) -> str:
    return f"its output projections have a bias (the mean compensation this run was given) that the {kind} config " \
           "cannot declare"


def vanilla_form(model) -> Vanilla | str:
    """The vanilla config (and class) that holds this compact model, or why none does."""
    kind = model.config.model_type
    if bias_not_in_config(model):
        return (f"{_bias_reason(kind)}: refit, the default when surgery.compensation is unset, or zero writes a "
                "vanilla one")
    if not removed_any(model):
        return Vanilla(model.config, None, None)
    if not arch.adapter_for(model).explicit_head_dim:
        return (f"the {kind} config derives the head width from hidden_size / heads, so it cannot describe "
                "fewer heads of the same width")
    q, kv = head_counts(model)
    if 0 in q:
        return (f"layers {[i for i, n in enumerate(q) if n == 0]} have no attention (selection.unit: layer), "
                "which no vanilla config can say")
    if len(set(q)) != 1 or len(set(kv)) != 1:
        return f"its head counts differ between layers ({_counts_text(model)})"
    config = _config_for(model.config, vanilla_updates(model))
    if isinstance(config, str) and kind in GGUF_UNIFORM:
        return f"{config} (every layer keeps {q[0]} heads: {GGUF_UNIFORM[kind]} runs it from `pruner export RUN --format gguf`)"
    if isinstance(config, str) or type(config) is type(model.config):
        return config if isinstance(config, str) else Vanilla(config, None, None)
    cls = SERVED_AS[kind][2]
    g = arch.geometry(model)
    return Vanilla(config, cls, (
        f"written as {cls}: transformers' {kind} config refuses {q[0]} heads with hidden size "
        f"{model.config.hidden_size} (it requires hidden_size % num_attention_heads == 0), while {cls} reads an "
        f"explicit head_dim ({g.head_dim}); with no sliding window, no biases and the base's rope parameters "
        f"({model.config.rope_parameters.get('rope_type', 'default')}) it computes the same function"))


def vanilla_reason(model) -> str | None:
    """Why no vanilla config describes this compact (heads removed) model, or None when one does."""
    form = vanilla_form(model)
    return form if isinstance(form, str) else None


def vanilla_model(model, form: Vanilla):
    """The compact model as its vanilla checkpoint's class: itself with the head counts in its config, or (a
    class change, `SERVED_AS`) that class sharing its tensors (no copy)."""
    if form.architecture is None:
        if removed_any(model):
            for key, value in vanilla_updates(model).items():  # Qwen2 gets an explicit head_dim here
                setattr(model.config, key, value)
        return model
    import transformers

    return _sharing(model, getattr(transformers, form.architecture), form.config)


def layout(model, removed: bool) -> tuple[str, str | None]:
    """(`dense` | `vanilla` | `per-layer`, why not vanilla). `removed`: the heads are physically gone."""
    if not removed:
        if bias_not_in_config(model):
            raise CheckpointError(
                f"cannot write a dense checkpoint: {_bias_reason(model.config.model_type)}. Export the compact form "
                "instead (`--format compact`: it declares that bias and loads with trust_remote_code=True or "
                "pruner.load), or re-run `pruner prune` with `--set surgery.compensation=refit` (plain weights, "
                "no bias) or `zero`")
        return "dense", None
    reason = vanilla_reason(model)
    return ("vanilla", None) if reason is None else ("per-layer", reason)


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
    return _sharing(model, modeling.per_layer_class(model.config.model_type, type(model).__name__), config)


def _sharing(model, cls, config):
    """A `cls(config)` holding `model`'s tensors (no copy): the same weights under another class."""
    with torch.device("meta"):
        new = cls(config)
    state = model.state_dict()
    try:
        new.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # the other class and the surgery disagree: a pruner bug, say where
        raise CheckpointError(f"the {cls.__name__} does not fit the pruned weights: "
                              f"{' '.join(str(e).split())[:400]}") from None
    buffers = dict(model.named_buffers())
    for name, _ in list(new.named_buffers()):  # non-persistent buffers (rotary frequencies) are not in state
        owner, _, leaf = name.rpartition(".")
        setattr(arch.get(new, owner) if owner else new, leaf, buffers[name])
    if getattr(model, "generation_config", None) is not None:
        new.generation_config = model.generation_config
    return new.eval()
