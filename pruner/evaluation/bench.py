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
for, from the geometry alone (`pruner.evaluation.ideal`; `shape_of` reads a model's). Realised close to ideal
means the implementation turns removed heads into time and bytes; far below it
means something else dominates (fixed overheads, kernels that do not shrink).
"""

from __future__ import annotations

import copy
import inspect
import os
import platform
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pruner.checkpoints import storage
from pruner.core import arch, runtime, tables
from pruner.evaluation.ideal import (
    decode_bytes,
    kv_bytes_per_token,
    module_params,
    prefill_flops,
    resident_bytes,
    saving,
    shape_of,
)
from pruner.evaluation.timing import BenchConfig, Schedule, Timings, measure
from pruner.pruning import surgery


def config_of(spec) -> BenchConfig:
    """The BenchConfig of a recipe's `bench` section."""
    return BenchConfig(lengths=tuple(spec.lengths), decode=tuple(tuple(c) for c in spec.decode),
                       new_tokens=spec.new_tokens, repeats=spec.repeats)


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
    from pruner.attention.sums import HeadStats
    from pruner.pruning.calibrate import weight_norms
    from pruner.pruning.scoring import ScoringInputs, get_scorer
    from pruner.pruning.selection import select

    if scorer not in ("random", "magnitude"):
        raise ValueError(f"weight_plan scores heads by `random` or `magnitude`, not {scorer!r}")
    g = arch.geometry(model)
    zero, rows = torch.zeros(g.n_layers, g.n_heads, dtype=torch.float64), torch.ones(g.n_layers)
    stats = HeadStats(sink_mass=zero, entropy_full=zero, entropy_content=zero, dormancy=zero, g=zero, rest=zero,
                      h_content_weighted=zero, rows=rows, content_rows=rows, excluded_rows=0 * rows, pairs={})
    inputs = ScoringInputs(stats=stats, gram=torch.empty(0), weight_norm=weight_norms(model), seed=seed)
    return select(get_scorer(scorer), inputs, g, cfg)


def checkpoint_dtype(spec, model) -> torch.dtype:
    """The dtype the base checkpoint of a recipe's `model` section is stored in (`storage.storage_dtype`:
    what an export stores by default), else the model's own."""
    found = storage.storage_dtype(spec)
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
        return tables.markdown_table(["figure", "base", "pruned", "saving [range over runs]", "ideal (basis)",
                                      "realised / ideal"], rows)

    def markdown(self) -> str:
        """The table with what it measured and where: the `bench` section of report.md and the model card."""
        c, h = self.conditions, self.heads
        cases = ", ".join(f"batch {b} from a {p}-token prompt" for b, p in c.get("decode", []))
        where = ("in ONNX Runtime GenAI (the builder's CPU models), a fresh process per model and round"
                 if c.get("runtime") == "onnxruntime-genai" else "in one process")
        return "\n".join([
            f"Base vs the compact model ({h['pruned']} of {h['total']} query heads and {h['kv_removed']} of "
            f"{h['kv_total']} KV heads removed), measured {where}: {c.get('dtype')} on {c.get('device')}, "
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


def timed(name: str, unit: str, base: list[float], pruned: list[float], ideal: float, basis: str,
           throughput: float | None = None) -> Figure:
    """A timed figure: medians, and the per-round savings' range (rounds pair base and pruned runs)."""
    per_round = [saving(b, p) for b, p in zip(base, pruned)]
    mb, mp = statistics.median(base), statistics.median(pruned)
    shown = (lambda t: throughput / t) if throughput else (lambda t: 1000 * t)  # tokens/s or ms
    return Figure(name, unit, shown(mb), shown(mp), saving(mb, mp), ideal, basis,
                  (min(per_round), max(per_round)), len(per_round))


def compare(base, pruned, plan: Schedule, rb: Timings, rp: Timings, checkpoint_dtype: torch.dtype | None = None,
            conditions: dict | None = None) -> BenchResult:
    """The figures of `pruned` against `base` from their measurements `rb` and `rp` (the same rounds)."""
    sb = shape_of(base)
    sp = shape_of(base, surgery.kept_heads(pruned))
    figs = [Figure("parameters", "", sb.params, module_params(pruned),
                   saving(sb.params, module_params(pruned)), saving(sb.params, sp.params), "q/k/v/o of removed heads")]
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
        figs.append(timed(f"prefill T={T}", "ms", rb.prefill[T], rp.prefill[T],
                           saving(prefill_flops(sb, T, n), prefill_flops(sp, T, n)), "FLOPs"))
    for b, P in plan.decode:
        context = P + plan.new_tokens / 2
        figs.append(timed(f"decode batch {b}, prompt {P}", "tokens/s", rb.decode[(b, P)], rp.decode[(b, P)],
                           saving(decode_bytes(sb, b, context), decode_bytes(sp, b, context)), "bytes moved",
                           throughput=b))
    if rb.memory and rp.memory and plan.memory is not None:
        b, P = plan.memory
        tokens = b * (P + plan.new_tokens)
        wb, wp = sb.params * sb.itemsize, module_params(pruned) * sb.itemsize
        mb, mp = wb + statistics.median(rb.memory), wp + statistics.median(rp.memory)
        what = f"batch {b}, prompt {P}" if b else f"prefill T={P}"
        figs.append(Figure(f"peak memory ({what})", "MB", mb / 1e6, mp / 1e6, saving(mb, mp),
                           saving(resident_bytes(sb, tokens), resident_bytes(sp, tokens)), "weights + KV cache",
                           None, len(rb.memory)))
    heads = {**heads_record(base, sb, sp),
             "compensation_params": module_params(pruned) - sp.params}  # biases mean compensation adds
    return BenchResult(figs, heads, conditions or {})


def heads_record(base, sb, sp) -> dict:
    """BenchResult's `heads`: query and KV heads removed of all, and the pruned model's per-layer counts."""
    return {"pruned": sum(sb.q_heads) - sum(sp.q_heads), "total": sum(sb.q_heads),
            "kv_removed": sum(sb.kv_heads) - sum(sp.kv_heads), "kv_total": sum(sb.kv_heads),
            "per_layer": list(sp.q_heads), "kv_per_layer": list(sp.kv_heads),
            "group_size": arch.geometry(base).group_size}


def conditions(model, cfg: BenchConfig, plan: Schedule, load_before: tuple[float, ...]) -> dict:
    """Where and how it was measured: what a reader needs to trust (or rerun) the timed figures."""
    import transformers

    device = runtime.input_device(model)
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


