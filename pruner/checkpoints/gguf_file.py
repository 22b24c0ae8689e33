"""GGUF for llama.cpp: a compact Llama, Mistral or Gemma 3 decoder written with llama.cpp's own Python writer (`gguf`).

Each family is a row of `FAMILIES` (data, not branches): the llama.cpp architectures, the tensor names, and
the conversions llama.cpp's own converter applies to that family. Two llama.cpp architectures hold a pruned
Llama or Mistral:

- `llama` when every layer keeps the same heads (what `selection.shape: servable` prunes);
- `deci`, the architecture llama.cpp runs NVIDIA's Nemotron-NAS models with, when layers keep different
  head counts or a layer lost every head: it reads `attention.head_count` / `attention.head_count_kv` as
  per-layer arrays and sizes each layer's q/k/v/o from them (0 heads: a layer without attention, what
  selection.unit: layer writes; its attention norm and projections are left out, and a compensation bias
  with them, so such a layer must carry none; and not layer 0, whose head count llama.cpp reads the head
  width from). Its block is otherwise Llama's, the output-projection bias
  included.

Both carry the key/value length and rope dimension explicitly (the head width stays the base's whatever
the head count). transformers' Llama rotates the two halves of a head (`rotate_half`); llama.cpp's rope for
these architectures rotates adjacent pairs, so q and k rows are permuted within each head as llama.cpp's
converter does. Llama 3's scaled rope goes in as the `rope_freqs` tensor of per-frequency divisors.
The tokenizer goes in as `pruner.checkpoints.gguf_vocab` writes it (`tokenizer_note` says where text
may split differently). 1-D tensors (norms, biases, rope factors) are float32, as llama.cpp's
converter stores them; matrices in the export dtype.

Gemma 3 goes in as llama.cpp's `gemma3`, and only with the same heads in every layer: that architecture sizes
every layer's q/k/v/o and its attention graph from layer 0's head count (`hparams.n_head()`), so per-layer
counts are refused. Any uniform count runs, 3 of 4 heads included, which transformers' Gemma config refuses.
As llama.cpp's converter writes Gemma 3: every RMSNorm weight (q/k norms included) stored as 1 + weight
(Gemma's norm scales by 1 + weight, llama.cpp's by the weight); no q/k permutation (its gemma3 rope rotates
halves, as transformers does); the sliding window with the per-layer sliding/global pattern written out, and
the two rope bases (global `rope.freq_base`, local `rope.freq_base_swa`). llama.cpp scales queries by
1/sqrt(head_dim) whatever `query_pre_attn_scalar` says, so where the two differ the ratio is folded into the
q-norm weight (exact: the norm is followed only by the rope, which is linear). It has no output-projection
bias, so mean compensation's folded bias is refused (refit carries its compensation as plain weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pruner.checkpoints import layout as forms
from pruner.checkpoints.gguf_vocab import GgufError, pre_tokenizer, spm_check, spm_vocab, vocab
from pruner.core import arch

DTYPES = ("float32", "float16", "bfloat16")
ROPES = ("default", "linear", "llama3")
INSTALL = 'pip install "pruner[gguf]"  (the gguf package, llama.cpp\'s own writer)'
_ATTENTION = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output"}
_MLP = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@dataclass(frozen=True)
class Family:
    """How one transformers family goes into llama.cpp, as llama.cpp's own converter writes it."""

    uniform: str                 # llama.cpp architecture when every layer keeps the same heads
    per_layer: str | None        # ... when layers keep different counts (None: llama.cpp has none that does)
    tensors: dict[str, str]      # transformers name within a layer -> GGUF name within `blk.<i>.`
    rope_pairs: bool             # llama.cpp's rope rotates adjacent pairs: permute q/k rows within each head
    norm_plus_one: bool          # the RMSNorms scale by 1 + weight: stored as 1 + weight
    tokenizer: str               # gpt2 (byte-level BPE) | llama (SentencePiece-style BPE, byte fallback)


LLAMA = Family("llama", "deci", {"input_layernorm.weight": "attn_norm.weight", **_ATTENTION,
                                 "post_attention_layernorm.weight": "ffn_norm.weight", **_MLP},
               rope_pairs=True, norm_plus_one=False, tokenizer="gpt2")
GEMMA3 = Family("gemma3", None, {"input_layernorm.weight": "attn_norm.weight", **_ATTENTION,
                                 "self_attn.q_norm.weight": "attn_q_norm.weight",
                                 "self_attn.k_norm.weight": "attn_k_norm.weight",
                                 "post_attention_layernorm.weight": "post_attention_norm.weight",
                                 "pre_feedforward_layernorm.weight": "ffn_norm.weight", **_MLP,
                                 "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
                rope_pairs=False, norm_plus_one=True, tokenizer="llama")
FAMILIES = {"llama": LLAMA, "mistral": LLAMA, "gemma3_text": GEMMA3}


@dataclass(frozen=True)
class Plan:
    """What the GGUF of a compact model holds."""

    arch: str                       # llama | deci | gemma3
    q_heads: tuple[int, ...]        # query heads per layer
    kv_heads: tuple[int, ...]       # key/value heads per layer
    head_dim: int
    pre: str                        # llama.cpp pre-tokenizer name
    family: Family = LLAMA


def require() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GgufError(f"GGUF export needs the gguf package, which is not installed: {INSTALL}") from None


def family_refusal(kind: str, uniform: bool) -> str | None:
    """Why pruner writes no GGUF for a `kind` model (`uniform`: every layer keeps the same heads), naming what
    would work; None for Llama and Mistral, and Gemma 3 with the same heads in every layer."""
    if kind in FAMILIES:
        if uniform or FAMILIES[kind].per_layer:
            return None
        return (f"llama.cpp's {FAMILIES[kind].uniform} architecture sizes every layer from layer 0's head count, "
                "and this run's layers keep different counts: prune with selection.shape: servable (the same "
                "heads in every layer), or export --format compact (pruner.load / trust_remote_code)")
    other = ("its uniform plans are vanilla checkpoints: export --format compact and convert with llama.cpp's "
             "convert_hf_to_gguf.py" if kind in ("qwen2", "qwen3") and uniform else
             "prune a Llama, Mistral or Gemma 3 model, or export --format compact (pruner.load / trust_remote_code)")
    why = {"qwen2": "Qwen2's q/k/v biases", "qwen3": "Qwen3's q/k norms"}.get(kind, f"the {kind} family")
    return ("pruner writes GGUF for Llama and Mistral (llama.cpp's llama and deci architectures) and Gemma 3 "
            f"(gemma3), not {why}: {other}")


def refusal(model) -> str | None:
    """Why llama.cpp cannot run this compact model as a GGUF pruner writes, naming what would; None if it can."""
    q, kv = forms.head_counts(model)
    empty = [i for i, n in enumerate(q) if n == 0]  # selection.unit: layer
    if empty and model.config.model_type in FAMILIES and not FAMILIES[model.config.model_type].per_layer:
        return (f"llama.cpp's {FAMILIES[model.config.model_type].uniform} architecture sizes every layer from layer "
                f"0's head count, so it cannot hold layers without attention ({empty}): export --format compact")
    family = family_refusal(model.config.model_type, len(set(q)) == 1 and len(set(kv)) == 1)
    if family:
        return family
    if 0 in empty:  # llama.cpp: `n_embd_head_k = n_embd / n_head()` only when n_head() > 0, else head width 0
        return ("llama.cpp reads the head width of every layer from layer 0's head count, so layer 0 must keep its "
                "attention for a GGUF (this run removed it): export --format compact")
    biased = [i for i in empty if arch.o_bias(model, i) is not None and bool(arch.o_bias(model, i).any())]
    if biased:
        return (f"llama.cpp's deci runs a layer without heads as attention-free, with no output bias, and layers "
                f"{biased} carry their mean output there (mean compensation): surgery.compensation zero, or "
                "export --format compact")
    if model.config.model_type == "gemma3_text":
        return _gemma3_refusal(model)
    rope = (getattr(model.config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in ROPES:
        return (f"llama.cpp's llama/deci rope takes {', '.join(ROPES)} scaling, not {rope!r}: export --format compact "
                "for transformers")
    if getattr(model.config, "sliding_window", None):
        return ("llama.cpp's llama/deci architectures attend to the whole context, and this model has a sliding "
                f"window of {model.config.sliding_window}: export --format compact for transformers")
    return None


def _gemma3_refusal(model) -> str | None:
    """What llama.cpp's gemma3 cannot hold of this Gemma 3: an output-projection bias (mean compensation), logit
    soft-capping inside attention, rope scaling other than linear; None if it holds all of it."""
    cfg = model.config
    if any(m.bias is not None for layer in _layers(model) for m in (layer.self_attn.q_proj, layer.self_attn.o_proj)):
        return ("llama.cpp's gemma3 architecture has no attention biases, and this model has some (mean "
                "compensation folds one into the output projection): prune with surgery.compensation: refit or "
                "zero, or export --format compact")
    if getattr(cfg, "attn_logit_softcapping", None):
        return "llama.cpp's gemma3 architecture has no attention logit soft-capping: export --format compact"
    for kind, rope in _gemma3_ropes(cfg).items():
        if rope.get("rope_type", "default") not in ("default", "linear" if kind == "full_attention" else "default"):
            return (f"llama.cpp's gemma3 takes default rope (and linear scaling on global layers), not "
                    f"{rope.get('rope_type')!r} on {kind} layers: export --format compact")
    return None


def _gemma3_ropes(cfg) -> dict:
    """Gemma 3's rope per layer type: {"full_attention": {...}, "sliding_attention": {...}}."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    return rope if "full_attention" in rope else {"full_attention": rope, "sliding_attention": rope}


def _layers(model):
    return getattr(model, model.base_model_prefix).layers


def plan(model, tokenizer) -> Plan:
    """The GGUF plan of a compact model, or GgufError before anything is written."""
    why = refusal(model)
    if why:
        raise GgufError(f"cannot write a GGUF: {why}")
    family = FAMILIES[model.config.model_type]
    q, kv = forms.head_counts(model)
    uniform = len(set(q)) == 1 and len(set(kv)) == 1
    pre = pre_tokenizer(tokenizer) if family.tokenizer == "gpt2" else spm_check(tokenizer)
    return Plan(family.uniform if uniform else family.per_layer, tuple(q), tuple(kv), arch.geometry(model).head_dim,
                pre, family)


def tokenizer_note(pre: str, family: Family = LLAMA) -> str | None:
    return None if pre == "gpt-2" or family.tokenizer == "llama" else (
        "llama.cpp does not know this tokenizer's pre-tokenizer, so the file names `default`: token ids given "
        "directly are exact; text may split into other tokens than transformers' in places")


def write(model, tokenizer, path: Path, dtype: str, gplan: Plan) -> None:
    """Write the compact `model` (+ tokenizer) as one GGUF file at `path` in `dtype`, a tensor at a time."""
    import gguf

    w = gguf.GGUFWriter(str(path), gplan.arch)
    _metadata(w, model, gplan, dtype)
    if gplan.family.tokenizer == "llama":
        spm_vocab(w, tokenizer, model.config.vocab_size)
    else:
        vocab(w, tokenizer, model.config.vocab_size, gplan.pre)
    tensors = list(_tensors(model, gplan))
    for name, t in tensors:
        w.add_tensor_info(name, tuple(t.shape), _np_dtype(t, dtype), t.numel() * _itemsize(t, dtype),
                          raw_dtype=gguf.GGMLQuantizationType.BF16 if _stored(t, dtype) == torch.bfloat16 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, t in tensors:
        w.write_tensor_data(_array(t, dtype))
    w.close()


def _stored(t: torch.Tensor, dtype: str) -> torch.dtype:
    return torch.float32 if t.dim() < 2 else getattr(torch, dtype)


def _itemsize(t, dtype) -> int:
    return torch.empty(0, dtype=_stored(t, dtype)).element_size()


def _np_dtype(t, dtype):
    import numpy as np

    return {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
            torch.bfloat16: np.dtype(np.int16)}[_stored(t, dtype)]


def _array(t: torch.Tensor, dtype: str):
    s = t.detach().to("cpu", _stored(t, dtype)).contiguous()
    return (s.view(torch.int16) if s.dtype == torch.bfloat16 else s).numpy()


def _metadata(w, model, gplan: Plan, dtype: str) -> None:
    import gguf

    cfg = model.config
    ftype = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
             "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    w.add_name(f"{getattr(cfg, '_name_or_path', '') or cfg.model_type} (pruned by pruner)")
    w.add_file_type(ftype)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(gplan.q_heads[0] if gplan.arch == "llama" else list(gplan.q_heads))
    w.add_head_count_kv(gplan.kv_heads[0] if gplan.arch == "llama" else list(gplan.kv_heads))
    w.add_key_length(gplan.head_dim)
    w.add_value_length(gplan.head_dim)
    w.add_rope_dimension_count(gplan.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if gplan.family is GEMMA3:
        _gemma3_metadata(w, cfg)
        return
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))


def _gemma3_metadata(w, cfg) -> None:
    """Gemma 3's sliding window (with which layers slide, written out rather than llama.cpp's default of every
    sixth layer global), its global and local rope bases, and its final-logit soft-capping."""
    import gguf

    ropes = _gemma3_ropes(cfg)
    full, local = ropes["full_attention"], ropes.get("sliding_attention", ropes["full_attention"])
    w.add_rope_freq_base(float(full.get("rope_theta", 1_000_000.0)))
    w.add_rope_freq_base_swa(float(local.get("rope_theta", 10_000.0)))
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full["factor"]))
    sliding = [t == "sliding_attention" for t in cfg.layer_types]
    if any(sliding) and cfg.sliding_window:
        w.add_sliding_window(int(cfg.sliding_window))
        w.add_sliding_window_pattern(sliding)
    if getattr(cfg, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))


def _permute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' rotate-half rows -> llama.cpp's adjacent-pair rows, within each of `heads` heads. (rows, ...)"""
    if heads == 0:
        return t
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _tensors(model, gplan: Plan):
    """(GGUF name, tensor) in file order: embeddings, each block (attention only where it keeps heads), head."""
    state = model.state_dict()
    base = model.base_model_prefix
    family = gplan.family
    yield "token_embd.weight", state[f"{base}.embed_tokens.weight"]
    for i in range(model.config.num_hidden_layers):
        prefix = f"{base}.layers.{i}."
        for hf, name in family.tensors.items():
            if gplan.q_heads[i] == 0 and (hf.startswith("self_attn") or hf.startswith("input_layernorm")):
                continue  # llama.cpp's attention-free deci layer: no norm, no projections
            for leaf in (("",) if hf.endswith(".weight") else (".weight", ".bias")):
                key = prefix + hf + leaf
                if key not in state:
                    continue
                t = state[key]
                if family.rope_pairs and hf == "self_attn.q_proj":
                    t = _permute(t, gplan.q_heads[i])
                elif family.rope_pairs and hf == "self_attn.k_proj":
                    t = _permute(t, gplan.kv_heads[i])
                if family.norm_plus_one and hf.endswith("norm.weight"):
                    t = t.float() + 1.0
                if hf == "self_attn.q_norm.weight":
                    t = t * _query_scale_ratio(model.config, gplan)
                yield f"blk.{i}.{name}{leaf}", t
    norm = state[f"{base}.norm.weight"]
    yield "output_norm.weight", norm.float() + 1.0 if family.norm_plus_one else norm
    if not model.config.tie_word_embeddings:
        yield "output.weight", state["lm_head.weight"]
    rope = getattr(model.config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_factors(rope, gplan.head_dim)


def _query_scale_ratio(cfg, gplan: Plan) -> float:
    """transformers' Gemma 3 query scale (query_pre_attn_scalar ** -0.5) over llama.cpp's gemma3 one
    (1/sqrt(head_dim); 1/sqrt(hidden / heads) for its 62-layer 27B): folded into the q-norm weight."""
    ours = cfg.query_pre_attn_scalar ** -0.5
    theirs = (cfg.hidden_size / gplan.q_heads[0] if cfg.num_hidden_layers == 62 else gplan.head_dim) ** -0.5
    return ours / theirs


def llama3_rope_factors(rope: dict, dim: int) -> torch.Tensor:
    """Llama 3's frequency scaling as llama.cpp's per-frequency divisors (its converter's formula). (dim / 2,)"""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def structure(path: Path) -> dict:
    """What a GGUF file holds, read back with the gguf reader alone: architecture, per-layer head counts, head
    width, tensor shapes (rows, cols as in transformers) and dtypes, tokenizer fields."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch_name = r.fields["general.architecture"].contents()
    n_layers = int(r.fields[f"{arch_name}.block_count"].contents())

    def per_layer(key: str) -> list[int]:
        v = r.fields[f"{arch_name}.attention.{key}"].contents()
        return [int(x) for x in v] if isinstance(v, list) else [int(v)] * n_layers

    def field(key: str):
        return r.fields[key].contents() if key in r.fields else None

    return {"arch": arch_name, "layers": n_layers, "q_heads": per_layer("head_count"),
            "kv_heads": per_layer("head_count_kv"), "key_length": field(f"{arch_name}.attention.key_length"),
            "value_length": field(f"{arch_name}.attention.value_length"),
            "rope_dim": field(f"{arch_name}.rope.dimension_count"), "file_type": field("general.file_type"),
            "tensors": {t.name: (tuple(int(x) for x in reversed(t.shape)), t.tensor_type.name) for t in r.tensors},
            "tokens": len(r.fields["tokenizer.ggml.tokens"].data), "pre": field("tokenizer.ggml.pre"),
            "bos": field("tokenizer.ggml.bos_token_id"), "eos": field("tokenizer.ggml.eos_token_id"),
            "tokenizer": field("tokenizer.ggml.model"), "sliding_window": field(f"{arch_name}.attention.sliding_window"),
            "sliding": field(f"{arch_name}.attention.sliding_window_pattern")}


def check_structure(path: Path, model, gplan: Plan, dtype: str) -> dict:
    """The written file against the plan and the model's tensors: arch, per-layer counts, head width, every
    tensor's name, shape and dtype. Returns the structure; raises GgufError on a difference."""
    got = structure(path)
    want = {name: (tuple(t.shape), {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[
        _stored(t, dtype)]) for name, t in _tensors(model, gplan)}
    wrong = [k for k in ("arch", "q_heads", "kv_heads", "key_length", "rope_dim") if
             got[k] != {"arch": gplan.arch, "q_heads": list(gplan.q_heads), "kv_heads": list(gplan.kv_heads),
                        "key_length": gplan.head_dim, "rope_dim": gplan.head_dim}[k]]
    if wrong or got["tensors"] != want:
        bad = wrong[0] if wrong else next(k for k in set(want) | set(got["tensors"])
                                          if want.get(k) != got["tensors"].get(k))
        raise GgufError(f"the written GGUF does not hold the model ({bad} differs); nothing was published")
    return got
