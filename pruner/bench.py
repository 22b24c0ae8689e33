"""What pruning buys: the base model against its pruned compact form, each gain next to its ideal.

Both models live in one process -- the compact copy shares every weight outside
the attention projections with the base (`compact_copy`), so it costs only its
own, smaller q/k/v/o -- and every timed case runs in interleaved rounds (base,
pruned, base, pruned, ...), so the load of a shared machine falls on both alike.
Timed figures are medians over the rounds; their spread is the range of the
per-round savings (each round pairs a base and a pruned run made seconds apart).

Figures (batch 1 unless stated):

- parameters, and checkpoint bytes: the safetensors weights file (what
  `save_pretrained` writes) in a temporary folder, in the base checkpoint's dtype;
- KV-cache bytes per token, read off the cache after a prefill;
- prefill latency at T tokens: the forward pass that fills the cache and keeps
  the logits of the last position only (what `generate` runs first);
- decode throughput: greedy `generate` with the cache, `new_tokens` new tokens,
  per (batch, prompt) case. A logits processor stamps every step, so only the
  per-token steps are timed, not the prompt. The prompt is prefilled once at
  batch 1 and its cache repeated over the batch rows (identical rows cost what
  different rows cost; it saves batch - 1 long prefills);
- peak memory: the weights plus the peak growth of resident memory (CPU:
  VmHWM after a reset; CUDA: max_memory_allocated) while the largest decode
  case prefills its prompt and decodes.

The ideal of each figure is the share of it that the removed heads account
for, from the geometry alone (`pruner.ideal`; `shape_of` reads a model's). Realised close to ideal
means the implementation turns removed heads into time and bytes; far below it
means something else dominates (fixed overheads, kernels that do not shrink).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import inspect
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from pruner import arch, models, report, surgery
from pruner.ideal import Shape, decode_bytes, kv_bytes_per_token, prefill_flops, resident_bytes, saving


@dataclass(frozen=True)
class BenchConfig:
    """What to time. Lengths and prompts beyond a learned position table are capped to fit it."""

    lengths: tuple[int, ...] = (512, 2048)                       # prefill latency, batch 1
    decode: tuple[tuple[int, int], ...] = ((1, 32), (8, 2048))   # (batch, prompt tokens)
    new_tokens: int = 128
    repeats: int = 5

    def __post_init__(self):
        if not self.lengths and not self.decode:
            raise ValueError("bench: nothing to time (no prefill lengths and no decode cases)")
        if min(self.lengths, default=1) < 1 or any(b < 1 or p < 1 for b, p in self.decode):
            raise ValueError("bench: lengths, batch sizes and prompts must be >= 1")
        if self.new_tokens < 2 or self.repeats < 1:
            raise ValueError("bench: new_tokens must be >= 2 (one step is timed against the next) and repeats >= 1")


def config_of(spec) -> BenchConfig:
    """The BenchConfig of a recipe's `bench` section."""
    return BenchConfig(lengths=tuple(spec.lengths), decode=tuple(tuple(c) for c in spec.decode),
                       new_tokens=spec.new_tokens, repeats=spec.repeats)


# --------------------------------------------------------------------------- the ideal of a model


def _module_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def shape_of(model, kept: dict[int, list[int]] | None = None) -> Shape:
    """The Shape of an unpruned model (`kept`: the heads a pruned copy keeps; default all)."""
    ad, g = arch.adapter_for(model), arch.geometry(model)
    block = arch.blocks(model)[0]
    d_model = arch.o_weight_cols(model, 0).shape[0]
    if ad.qkv_layout == "separate":
        q_bias = arch.get(block, ad.q).bias is not None
        kv_bias = arch.get(block, ad.k).bias is not None
    else:
        q_bias = kv_bias = arch.get(block, ad.qkv).bias is not None
    hd = g.head_dim
    attn_weights = g.n_heads * 2 * d_model * hd + g.n_kv_heads * 2 * d_model * hd
    other = tuple(sum(p.numel() for p in b.parameters() if p.dim() >= 2) - attn_weights for b in arch.blocks(model))
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding_only = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    elsewhere = {id(p) for m in model.modules() if not isinstance(m, nn.Embedding)
                 for p in m.parameters(recurse=False)}
    read = sum(p.numel() for p in model.parameters() if id(p) not in embedding_only or id(p) in elsewhere)
    full = Shape(q_heads=(g.n_heads,) * g.n_layers, kv_heads=(g.n_kv_heads,) * g.n_layers, d_model=d_model,
                 d_head=hd, q_head_params=hd * d_model + hd * q_bias, o_head_params=hd * d_model,
                 kv_head_params=2 * (hd * d_model + hd * kv_bias), other_weights=other,
                 logits_width=out_emb.weight.numel() if out_emb is not None else 0,
                 params=_module_params(model), read_params=read,
                 itemsize=next(model.parameters()).element_size(), causal=models.attends_causally(model))
    if kept is None:
        return full
    heads = [kept[layer] for layer in range(g.n_layers)]
    return full.with_heads(tuple(len(h) for h in heads), tuple(len({x // g.group_size for x in h}) for h in heads))


# --------------------------------------------------------------------------- models


def compact_copy(base, heads: surgery.HeadSet, compensation=None):
    """`base` with `heads` physically removed, sharing every weight outside q/k/v/o with `base`.

    `base` is left as it was; the copy costs only its own attention projections,
    so base and pruned fit in memory together.
    """
    ad = arch.adapter_for(base)
    own = set()
    for block in arch.blocks(base):
        for path in (ad.q, ad.k, ad.v, ad.qkv, ad.o_proj):
            if path is not None:
                own |= {id(p) for p in arch.get(block, path).parameters()}
    memo = {id(p): p for p in base.parameters() if id(p) not in own}
    memo.update({id(b): b for b in base.buffers()})
    pruned = copy.deepcopy(base, memo)
    surgery.remove_heads(pruned, heads, compensation)  # a surgery.Compensation (or {layer: bias}, or None)
    return pruned


def weight_plan(model, cfg, scorer: str = "random", seed: int = 0):
    """A plan from the weights alone (`random` or `magnitude` scores) through the usual selection:
    what measuring the gains of removal needs, without calibration data (benchmarks, tests)."""
    from pruner.calibrate import weight_norms
    from pruner.scoring import ScoringInputs, get_scorer
    from pruner.selection import select
    from pruner.stats import HeadStats

    if scorer not in ("random", "magnitude"):
        raise ValueError(f"weight_plan scores heads by `random` or `magnitude`, not {scorer!r}")
    g = arch.geometry(model)
    zero, rows = torch.zeros(g.n_layers, g.n_heads, dtype=torch.float64), torch.ones(g.n_layers)
    stats = HeadStats(sink_mass=zero, entropy_full=zero, entropy_content=zero, dormancy=zero, g=zero, rest=zero,
                      h_content_weighted=zero, rows=rows, content_rows=rows, excluded_rows=0 * rows, pairs={})
    inputs = ScoringInputs(stats=stats, gram=torch.empty(0), weight_norm=weight_norms(model), seed=seed)
    return select(get_scorer(scorer), inputs, g, cfg)


def max_positions(model) -> int | None:
    """Longest input a learned position table allows; None for rotary models (any length runs)."""
    c = model.config
    if getattr(c, "rope_parameters", None) or getattr(c, "rope_theta", None) or c.model_type == "gpt_neox":
        return None
    n = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None)
    if n is not None and c.model_type == "roberta":  # positions start after the padding index
        n -= (c.pad_token_id or 0) + 1
    return n


def checkpoint_dtype(spec, model) -> torch.dtype:
    """The dtype the base checkpoint of a recipe's `model` section is stored in (`compact.storage_dtype`:
    what an export stores by default), else the model's own."""
    from pruner import compact

    found = compact.storage_dtype(spec)
    return getattr(torch, found) if found else next(model.parameters()).dtype


def checkpoint_bytes(model, dtype: torch.dtype | None = None) -> int:
    """Bytes of the safetensors weights file of `model` stored in `dtype` (default: its own).

    The file `save_pretrained` writes -- every tensor of the state dict, tied weights
    once -- written directly, because `save_pretrained` also validates the config,
    and a vanilla config cannot describe every pruned model (e.g. 24 heads of
    2048 / 24 channels): the bytes are the same, the config is another matter
    (pruner's per-layer checkpoint format).
    """
    from safetensors.torch import save_file

    state, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape)
        if key in seen:  # tied to a tensor already stored (e.g. the LM head to the embeddings)
            continue
        seen.add(key)
        state[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    with tempfile.TemporaryDirectory(prefix="pruner-bench-") as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(state, str(path), metadata={"format": "pt"})
        return path.stat().st_size


# --------------------------------------------------------------------------- measurement plumbing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _proc_kib(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1])


class _Peak:
    """Peak memory growth of a block. CPU: VmHWM after a reset (free heap returned to the OS first,
    so the growth is live memory); CUDA: max_memory_allocated. `growth` stays None where neither works."""

    def __init__(self, device: torch.device):
        self.device, self.growth, self.start = device, None, None

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return self
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter
            self.start = _proc_kib("VmRSS") * 1024
        except OSError:  # not Linux/glibc: no CPU peak
            self.start = None
        return self

    def __exit__(self, *exc):
        if self.start is None:
            return
        if self.device.type == "cuda":
            self.growth = torch.cuda.max_memory_allocated(self.device) - self.start
        else:
            self.growth = _proc_kib("VmHWM") * 1024 - self.start


def _cache_layers(cache):
    cache = getattr(cache, "self_attention_cache", cache)  # encoder-decoder wrappers
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_bytes(cache) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in _cache_layers(cache))


class _Stamps:
    """A logits processor that only records when each generation step's logits are ready."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        _sync(self.device)
        self.times.append(time.perf_counter())
        return scores


@dataclass
class _Runs:
    """One model's raw measurements, one entry per round."""

    prefill: dict[int, list[float]]
    decode: dict[tuple[int, int], list[float]]  # seconds per decode step
    memory: list[int]
    kv_per_token: float | None = None


@dataclass(frozen=True)
class _Plan:
    """The cases after capping to the position table; `memory`: the case whose peak is measured."""

    lengths: tuple[int, ...]
    decode: tuple[tuple[int, int], ...]
    new_tokens: int
    memory: tuple[int, int] | None   # (batch, prompt), or (0, T) for a prefill when nothing decodes

    @property
    def prompts(self) -> list[int]:
        return sorted(set(self.lengths) | {p for _, p in self.decode})


def _plan(model, cfg: BenchConfig) -> _Plan:
    cap = max_positions(model)
    lengths = tuple(sorted({min(T, cap) if cap else T for T in cfg.lengths}))
    decode: tuple[tuple[int, int], ...] = ()
    if models.attends_causally(model) and hasattr(model, "generate") and model.can_generate():
        room = cap - cfg.new_tokens - 1 if cap else None  # prompt + 1 + new tokens must fit
        if room is not None and room < 1:
            raise ValueError(f"bench: {cfg.new_tokens} new tokens do not fit the {cap}-position table")
        decode = tuple(sorted({(b, min(p, room) if room else p) for b, p in cfg.decode}))
    memory = max(decode, key=lambda c: c[0] * c[1]) if decode else ((0, max(lengths)) if lengths else None)
    return _Plan(lengths, decode, cfg.new_tokens, memory)


def _forward_kwargs(model, causal: bool) -> dict:
    params = inspect.signature(model.forward).parameters
    kw = {"use_cache": True} if causal else {}
    if "logits_to_keep" in params:
        kw["logits_to_keep"] = 1
    return kw


def _prefill(model, ids: torch.Tensor, causal: bool):
    """(seconds, cache or None) of one forward over `ids` (1, T)."""
    device = ids.device
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, **_forward_kwargs(model, causal))
    _sync(device)
    return time.perf_counter() - t0, getattr(out, "past_key_values", None) if causal else None


def _decode(model, prompt: torch.Tensor, cache, batch: int, new_tokens: int) -> float:
    """Seconds per decode step of greedy `generate` at `batch` rows from `prompt` (1, P + 1) whose
    first P tokens are in `cache` (consumed: repeated over the rows in place)."""
    from transformers import GenerationConfig, LogitsProcessorList

    if batch > 1:
        cache.batch_repeat_interleave(batch)
    ids = prompt.expand(batch, -1).contiguous()
    stamps = _Stamps(ids.device)
    eos = model.config.eos_token_id
    gen = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           eos_token_id=eos, pad_token_id=model.config.pad_token_id or 0)
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, generation_config=gen,
                   logits_processor=LogitsProcessorList([stamps]))
    return (stamps.times[-1] - stamps.times[0]) / (len(stamps.times) - 1)


def _round(model, plan: _Plan, ids: torch.Tensor, runs: _Runs | None) -> None:
    """Every case once on one model; `runs` None is a warm-up (nothing recorded)."""
    causal = bool(plan.decode) or models.attends_causally(model)
    for P in plan.prompts:
        batches = sorted(b for b, p in plan.decode if p == P)
        watch = runs is not None and plan.memory is not None and plan.memory[1] == P
        with _Peak(ids.device) if watch else contextlib.nullcontext() as peak:
            seconds, cache = _prefill(model, ids[:, :P], causal)
            if runs is not None and cache is not None and runs.kv_per_token is None:
                runs.kv_per_token = cache_bytes(cache) / P
            for i, b in enumerate(batches):  # the largest batch last, consuming the prefill's cache
                own = cache if i == len(batches) - 1 else copy.deepcopy(cache)
                step = _decode(model, ids[:, :P + 1], own, b, plan.new_tokens)
                if runs is not None:
                    runs.decode[(b, P)].append(step)
            del cache
        if runs is not None:
            if P in plan.lengths:
                runs.prefill[P].append(seconds)
            if watch and peak.growth is not None:
                runs.memory.append(peak.growth)


def _warm_plan(plan: _Plan) -> _Plan:
    """A small round with the same kinds of cases: loads kernels and lazy imports before timing."""
    small = min(16, *plan.prompts)
    return _Plan((small,) if plan.lengths else (), tuple(sorted({(b, small) for b, _ in plan.decode})), 3, None)


def measure(models_: dict[str, object], cfg: BenchConfig, progress: bool = False) -> tuple[_Plan, dict[str, _Runs]]:
    """Every case on every model, in `cfg.repeats` interleaved rounds after a warm-up round."""
    from tqdm.auto import tqdm

    first = next(iter(models_.values()))
    plan = _plan(first, cfg)
    device = models.input_device(first)
    vocab = first.config.vocab_size
    ids = torch.randint(min(3, vocab - 1), vocab, (1, max(plan.prompts) + 1),
                        generator=torch.Generator().manual_seed(0)).to(device)
    runs = {name: _Runs({T: [] for T in plan.lengths}, {c: [] for c in plan.decode}, []) for name in models_}
    jobs = [(r, name) for r in range(cfg.repeats + 1) for name in models_]
    with torch.inference_mode():
        for r, name in (tqdm(jobs, desc="bench", unit="run") if progress else jobs):
            _round(models_[name], _warm_plan(plan) if r == 0 else plan, ids, runs[name] if r else None)
    return plan, runs


# --------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class Figure:
    """One measured quantity, base vs pruned, and the ideal saving the removed heads account for."""

    name: str
    unit: str
    base: float
    pruned: float
    saving: float                 # 1 - pruned/base of the cost (time per token for throughputs)
    ideal: float                  # share of the base cost the removed heads account for
    basis: str                    # what the ideal counts
    spread: tuple[float, float] | None = None  # min, max of the per-round savings
    runs: int = 1

    @property
    def of_ideal(self) -> float | None:
        return self.saving / self.ideal if self.ideal > 1e-12 else None


@dataclass(frozen=True)
class BenchResult:
    figures: list[Figure]
    heads: dict                   # pruned / total query heads, removed / total KV heads
    conditions: dict              # device, dtype, threads, repeats, load average, versions

    @classmethod
    def from_dict(cls, d: dict) -> "BenchResult":
        """Back from `to_dict` (metrics.json's `bench` block)."""
        keys = set(Figure.__dataclass_fields__)
        figs = [Figure(**{**{k: v for k, v in f.items() if k in keys},
                          "spread": tuple(f["spread"]) if f.get("spread") else None}) for f in d["figures"]]
        return cls(figs, d["heads"], d["conditions"])

    def figure(self, name: str) -> Figure:
        return next(f for f in self.figures if f.name == name)

    def to_dict(self) -> dict:
        figs = []
        for f in self.figures:
            d = asdict(f)
            d["spread"] = list(f.spread) if f.spread else None
            d["of_ideal"] = f.of_ideal
            figs.append(d)
        return {"heads": self.heads, "conditions": self.conditions, "figures": figs}

    def table(self) -> str:
        """Markdown: one row per figure; the saving with its run-to-run range for timed figures."""
        rows = []
        for f in self.figures:
            spread = f" [{100 * f.spread[0]:+.1f}, {100 * f.spread[1]:+.1f}]" if f.spread else ""
            rows.append([f"{f.name} ({f.unit})" if f.unit else f.name, _fmt(f.base), _fmt(f.pruned), f"{100 * f.saving:+.1f}%{spread}",
                         f"{100 * f.ideal:.1f}% ({f.basis})",
                         "—" if f.of_ideal is None else f"{f.of_ideal:.2f}"])
        return report.markdown_table(["figure", "base", "pruned", "saving [range over runs]", "ideal (basis)",
                                      "realised / ideal"], rows)

    def markdown(self) -> str:
        """The table with what it measured and where: the `bench` section of report.md and the model card."""
        c, h = self.conditions, self.heads
        cases = ", ".join(f"batch {b} from a {p}-token prompt" for b, p in c.get("decode", []))
        return "\n".join([
            f"Base vs the compact model ({h['pruned']} of {h['total']} query heads and {h['kv_removed']} of "
            f"{h['kv_total']} KV heads removed), measured in one process: {c.get('dtype')} on {c.get('device')}, "
            f"{c.get('threads')} threads, median of {c.get('repeats')} interleaved rounds (load average "
            f"{_load(c)}). Prefill: batch 1, the last position's logits; decode: greedy generation with the KV "
            f"cache, {c.get('new_tokens')} new tokens" + (f", {cases}" if cases else "") + ".", "",
            self.table(), "",
            *([f"The pruned parameters include {h['compensation_params']:,} bias entries that mean compensation "
               "adds (the ideal counts head removal alone).", ""] if h.get("compensation_params") else []),
            "Ideal: the share of the base figure that the removed heads account for (parameters: their "
            "q/k/v/o slices; prefill: FLOPs; decode: bytes moved per step, weights plus the KV cache read; "
            "peak memory: weights plus the KV cache). Realised / ideal near 1 means removing heads turned into "
            "that saving; timed figures on a shared CPU vary from run to run (the range over rounds)."])

    def summary(self) -> str:
        """A few lines for the terminal: every figure base -> pruned, its saving and the ideal."""
        h, c = self.heads, self.conditions
        lines = [f"what the compact model buys ({h['pruned']}/{h['total']} heads, {h['kv_removed']}/{h['kv_total']} "
                 f"KV heads removed; {c.get('dtype')}, median of {c.get('repeats')} rounds, load {_load(c)}):"]
        for f in self.figures:
            lines.append(f"  {f.name}: {_fmt(f.base)} -> {_fmt(f.pruned)}{' ' + f.unit if f.unit else ''} (saving {100 * f.saving:+.1f}%, "
                         f"ideal {100 * f.ideal:.1f}%)")
        return "\n".join(lines)


def _load(c: dict) -> str:
    before, after = c.get("load_average_before"), c.get("load_average_after")
    return f"{before[0]:.2f} before, {after[0]:.2f} after" if before and after else "not recorded"


def _fmt(x: float) -> str:
    if float(x).is_integer() and abs(x) >= 1000:
        return f"{int(x):,}"
    return f"{x:.4g}" if abs(x) < 1000 else f"{x:,.0f}"


def _timed(name: str, unit: str, base: list[float], pruned: list[float], ideal: float, basis: str,
           throughput: float | None = None) -> Figure:
    """A timed figure: medians, and the per-round savings' range (rounds pair base and pruned runs)."""
    per_round = [saving(b, p) for b, p in zip(base, pruned)]
    mb, mp = statistics.median(base), statistics.median(pruned)
    shown = (lambda t: throughput / t) if throughput else (lambda t: 1000 * t)  # tokens/s or ms
    return Figure(name, unit, shown(mb), shown(mp), saving(mb, mp), ideal, basis,
                  (min(per_round), max(per_round)), len(per_round))


def compare(base, pruned, plan: _Plan, rb: _Runs, rp: _Runs, checkpoint_dtype: torch.dtype | None = None,
            conditions: dict | None = None) -> BenchResult:
    """The figures of `pruned` against `base` from their measurements `rb` and `rp` (the same rounds)."""
    sb = shape_of(base)
    sp = shape_of(base, surgery.kept_heads(pruned))
    figs = [Figure("parameters", "", sb.params, _module_params(pruned),
                   saving(sb.params, _module_params(pruned)), saving(sb.params, sp.params), "q/k/v/o of removed heads")]
    dt = checkpoint_dtype or next(base.parameters()).dtype
    cb, cp_ = checkpoint_bytes(base, dt), checkpoint_bytes(pruned, dt)
    figs.append(Figure("checkpoint", f"MB, {str(dt).removeprefix('torch.')}", cb / 1e6, cp_ / 1e6, saving(cb, cp_),
                       saving(sb.params, sp.params), "parameters"))
    if rb.kv_per_token is not None:
        figs.append(Figure("KV cache", "bytes/token", rb.kv_per_token, rp.kv_per_token,
                           saving(rb.kv_per_token, rp.kv_per_token),
                           saving(kv_bytes_per_token(sb), kv_bytes_per_token(sp)), "KV heads"))
    logits = 1 if "logits_to_keep" in inspect.signature(base.forward).parameters else None
    for T in plan.lengths:
        n = logits or T
        figs.append(_timed(f"prefill T={T}", "ms", rb.prefill[T], rp.prefill[T],
                           saving(prefill_flops(sb, T, n), prefill_flops(sp, T, n)), "FLOPs"))
    for b, P in plan.decode:
        context = P + plan.new_tokens / 2
        figs.append(_timed(f"decode batch {b}, prompt {P}", "tokens/s", rb.decode[(b, P)], rp.decode[(b, P)],
                           saving(decode_bytes(sb, b, context), decode_bytes(sp, b, context)), "bytes moved",
                           throughput=b))
    if rb.memory and rp.memory and plan.memory is not None:
        b, P = plan.memory
        tokens = b * (P + plan.new_tokens)
        wb, wp = sb.params * sb.itemsize, _module_params(pruned) * sb.itemsize
        mb, mp = wb + statistics.median(rb.memory), wp + statistics.median(rp.memory)
        what = f"batch {b}, prompt {P}" if b else f"prefill T={P}"
        figs.append(Figure(f"peak memory ({what})", "MB", mb / 1e6, mp / 1e6, saving(mb, mp),
                           saving(resident_bytes(sb, tokens), resident_bytes(sp, tokens)), "weights + KV cache",
                           None, len(rb.memory)))
    g = arch.geometry(base)
    heads = {"pruned": sum(sb.q_heads) - sum(sp.q_heads), "total": sum(sb.q_heads),
             "kv_removed": sum(sb.kv_heads) - sum(sp.kv_heads), "kv_total": sum(sb.kv_heads),
             "per_layer": list(sp.q_heads), "kv_per_layer": list(sp.kv_heads), "group_size": g.group_size,
             "compensation_params": _module_params(pruned) - sp.params}  # biases mean compensation adds
    return BenchResult(figs, heads, conditions or {})


def conditions(model, cfg: BenchConfig, plan: _Plan, load_before: tuple[float, ...]) -> dict:
    """Where and how it was measured: what a reader needs to trust (or rerun) the timed figures."""
    import transformers

    device = models.input_device(model)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "repeats": cfg.repeats, "new_tokens": plan.new_tokens,
            "lengths": list(plan.lengths), "decode": [list(c) for c in plan.decode],
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__, "transformers": transformers.__version__}


def bench(base, pruned, cfg: BenchConfig = BenchConfig(), checkpoint_dtype: torch.dtype | None = None,
          progress: bool = False) -> BenchResult:
    """Base vs pruned compact model: measured in one process, interleaved, against the ideal."""
    load = os.getloadavg()
    plan, runs = measure({"base": base, "pruned": pruned}, cfg, progress)
    return compare(base, pruned, plan, runs["base"], runs["pruned"], checkpoint_dtype,
                   conditions(base, cfg, plan, load))


def run_section(folder: str | Path, metrics: dict) -> str | None:
    """What a run's compact model buys, as markdown for its model card: `pruner bench`'s bench.json when
    the run folder has one (full length), else the block `prune` measured; None when neither exists."""
    path = Path(folder) / "bench.json"
    if path.exists():
        d, how = json.loads(path.read_text()), "`pruner bench`"
    elif metrics.get("bench"):
        d, how = metrics["bench"], "`pruner prune` (its recipe's `bench` section)"
    else:
        return None
    return f"Measured by {how}. " + BenchResult.from_dict(d).markdown()


def bench_run(run_dir: str | Path, cfg: BenchConfig = BenchConfig(), dtype: str | None = None,
              progress: bool = True) -> BenchResult:
    """`pruner bench RUN_DIR`: the run's base model (its recipe) against its plan's compact form.

    `dtype` loads the base in another dtype than the recipe's (e.g. bfloat16 on a CPU with AMX);
    the checkpoint figure stays in the base checkpoint's own dtype.
    """
    from pruner.export import load_run  # imported here: export's model card renders BenchResult

    run = load_run(Path(run_dir))
    spec = run.recipe.model
    if spec.path == "(in memory)":
        raise ValueError(f"{run_dir} was pruned from a model built in memory: bench needs its base, so call "
                         "pruner.bench.bench(base, compact_copy(base, heads)) on the model you hold")
    base = models.load_base(spec if dtype is None else spec.model_copy(update={"dtype": dtype}))
    if dtype is not None:
        base = base.to(getattr(torch, dtype))  # a no-op unless the loader has its own dtype (the MLM readout)
    pruned = compact_copy(base, run.heads, run.bias)
    return bench(base, pruned, cfg, checkpoint_dtype(run.recipe.model, base), progress)
