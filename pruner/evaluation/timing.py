"""Timing base and pruned models: interleaved rounds of prefills and cached greedy decoding, with peak memory.

Every timed case runs in interleaved rounds (base, pruned, base, pruned, ...), so the load
of a shared machine falls on both alike; round 0 warms up and is not kept.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import time
from dataclasses import dataclass

import torch

from pruner.core import host_memory, proc_status, runtime


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


def max_positions(model) -> int | None:
    """Longest input a learned position table allows; None for rotary models (any length runs)."""
    c = model.config
    if getattr(c, "rope_parameters", None) or getattr(c, "rope_theta", None) or c.model_type == "gpt_neox":
        return None
    n = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None)
    if n is not None and c.model_type == "roberta":  # positions start after the padding index
        n -= (c.pad_token_id or 0) + 1
    return n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        if not host_memory.can_release():  # not glibc: freed heap stays resident, the growth would not be live
            return self
        host_memory.release_freed()
        self.start = proc_status.status().get("VmRSS") if proc_status.reset_peak() else None  # None: not Linux
        return self

    def __exit__(self, *exc):
        if self.start is None:
            return
        if self.device.type == "cuda":
            self.growth = torch.cuda.max_memory_allocated(self.device) - self.start
        else:
            self.growth = proc_status.status()["VmHWM"] - self.start


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
class Timings:
    """One model's raw measurements, one entry per round."""

    prefill: dict[int, list[float]]
    decode: dict[tuple[int, int], list[float]]  # seconds per decode step
    memory: list[int]
    kv_per_token: float | None = None


@dataclass(frozen=True)
class Schedule:
    """The cases after capping to the position table; `memory`: the case whose peak is measured."""

    lengths: tuple[int, ...]
    decode: tuple[tuple[int, int], ...]
    new_tokens: int
    memory: tuple[int, int] | None   # (batch, prompt), or (0, T) for a prefill when nothing decodes

    @property
    def prompts(self) -> list[int]:
        return sorted(set(self.lengths) | {p for _, p in self.decode})


def schedule(model, cfg: BenchConfig) -> Schedule:
    cap = max_positions(model)
    lengths = tuple(sorted({min(T, cap) if cap else T for T in cfg.lengths}))
    decode: tuple[tuple[int, int], ...] = ()
    if runtime.attends_causally(model) and hasattr(model, "generate") and model.can_generate():
        room = cap - cfg.new_tokens - 1 if cap else None  # prompt + 1 + new tokens must fit
        if room is not None and room < 1:
            raise ValueError(f"bench: {cfg.new_tokens} new tokens do not fit the {cap}-position table")
        decode = tuple(sorted({(b, min(p, room) if room else p) for b, p in cfg.decode}))
    memory = max(decode, key=lambda c: c[0] * c[1]) if decode else ((0, max(lengths)) if lengths else None)
    return Schedule(lengths, decode, cfg.new_tokens, memory)


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


def _round(model, plan: Schedule, ids: torch.Tensor, runs: Timings | None) -> None:
    """Every case once on one model; `runs` None is a warm-up (nothing recorded)."""
    causal = bool(plan.decode) or runtime.attends_causally(model)
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


def _warm_plan(plan: Schedule) -> Schedule:
    """A small round with the same kinds of cases: loads kernels and lazy imports before timing."""
    small = min(16, *plan.prompts)
    return Schedule((small,) if plan.lengths else (), tuple(sorted({(b, small) for b, _ in plan.decode})), 3, None)


def measure(models_: dict[str, object], cfg: BenchConfig, progress: bool = False) -> tuple[Schedule, dict[str, Timings]]:
    """Every case on every model, in `cfg.repeats` interleaved rounds after a warm-up round."""
    from tqdm.auto import tqdm

    first = next(iter(models_.values()))
    plan = schedule(first, cfg)
    device = runtime.input_device(first)
    vocab = first.config.vocab_size
    ids = torch.randint(min(3, vocab - 1), vocab, (1, max(plan.prompts) + 1),
                        generator=torch.Generator().manual_seed(0)).to(device)
    runs = {name: Timings({T: [] for T in plan.lengths}, {c: [] for c in plan.decode}, []) for name in models_}
    jobs = [(r, name) for r in range(cfg.repeats + 1) for name in models_]
    with torch.inference_mode():
        for r, name in (tqdm(jobs, desc="bench", unit="run") if progress else jobs):
            _round(models_[name], _warm_plan(plan) if r == 0 else plan, ids, runs[name] if r else None)
    return plan, runs
