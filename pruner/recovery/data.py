"""The recovery tokens: windows of a data source the recipes accept, or text the teacher samples itself.

`generated` needs nothing beyond the model (self-data distillation); in a list it is one source
among the others (the teacher's text beside the user's own kinds of text). Every generated window starts
with the sink token a run's windows start with and continues with tokens the teacher
samples at `temperature_generate`, from a seeded generator, so the same seed gives the
same windows. They are kept as token ids (no detokenise/retokenise round trip) in a cache
file named by everything they depend on, so a second recovery of the same run reads them.

A held-back slice (`validation`) is the validation set of the guard; the evaluation
windows of the run are never trained on: a source that is, or holds, the evaluation text is
refused before anything is computed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pruner.core import arch, assets, data, runtime
from pruner.core.mixture import concat, shares, take
from pruner.recovery.spec import GENERATED, RecoverySpec

MAX_VALIDATION = 32  # windows: enough for a stable mean KL, cheap enough to measure often


class RecoveryError(ValueError):
    """A recovery that cannot run as asked; one line, said before any training."""


@dataclass(frozen=True)
class Windows:
    """Training and validation windows. input_ids, attention_mask: (window, T)."""

    train: data.TokenBatch
    validation: data.TokenBatch
    source: str            # what they were read from (`generated` or the data spec)
    epochs: float          # passes over the source's windows the budget makes (generated: 1)


def counts(spec: RecoverySpec) -> tuple[int, int]:
    """(training windows, validation windows) the budget asks for; a budget below one batch is refused."""
    if spec.tokens < spec.window_tokens:
        raise RecoveryError(f"recovery.tokens: {spec.tokens} is below one batch ({spec.batch_size} windows x "
                            f"{spec.length} tokens = {spec.window_tokens}); raise it or lower recovery.batch_size")
    train = spec.tokens // spec.window_tokens * spec.batch_size
    return train, min(MAX_VALIDATION, max(1, math.ceil(train * spec.validation)))


def _local(path: str) -> Path | None:
    if path.startswith("shakespeare:"):
        return Path(assets.shakespeare(path.split(":", 1)[1])).resolve()
    p = Path(path).expanduser()
    return p.resolve() if p.exists() else None


def check_overlap(spec: RecoverySpec, evaluation) -> None:
    """Refuse a recovery source (any of a list's) that is (or contains, or lies in) the run's evaluation text
    (`evaluation`: the recipe's evaluation section)."""
    for source in spec.sources:
        if source == GENERATED:
            continue
        same = (source, spec.name, spec.split) == (evaluation.data, evaluation.name, evaluation.split)
        a, b = _local(source), _local(evaluation.data)
        if not same and a is not None and b is not None:
            same = a == b or a in b.parents or b in a.parents
        if same:
            raise RecoveryError(f"recovery.data: {source} overlaps the evaluation windows ({evaluation.data}), "
                                "which recovery never trains on; use another source (e.g. shakespeare:train) or "
                                "the default, generated")


def from_source(spec: RecoverySpec, tokenizer, n_train: int, n_val: int, texts: list[str] | None = None,
                generate: Callable[[int, int], Windows] | None = None) -> Windows:
    """Windows of a data source (or of `texts` given in memory), shuffled by the seed; the validation slice first,
    the budget cycling over the rest when the source is shorter than the budget. A list of sources: each gives its
    share (`spec.weights`, default equal) of the training and of the validation windows (largest remainders), drawn
    as it would be alone (a source whose share is zero is not read), and the training windows are interleaved by a
    seeded permutation, so every batch mixes the kinds of text.
    `generate(n_train, n_val)`: the `generated` source's windows (`generated` bound to the teacher), called only
    when a source is `generated`."""

    def one(source: str, t: int, v: int, given: list[str] | None = None) -> Windows:
        if source != GENERATED or given is not None:
            return _windows(spec, source, tokenizer, t, v, given)
        if generate is None:
            raise RecoveryError("recovery.data: generated needs the teacher to sample from")
        return generate(t, v)

    if texts is not None or len(spec.sources) == 1:
        return one(spec.sources[0], n_train, n_val, texts)
    w = spec.shares()
    parts = [one(s, t, v) for s, t, v in zip(spec.sources, shares(n_train, w), shares(n_val, w)) if t + v > 0]
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(spec.seed))
    named = spec.sources if spec.weights is None else [f"{x} ×{v:g}" for x, v in zip(spec.sources, w)]
    return Windows(take(concat([p.train for p in parts]), order), concat([p.validation for p in parts]),
                   ", ".join(named), max(p.epochs for p in parts))


def _windows(spec: RecoverySpec, source: str, tokenizer, n_train: int, n_val: int,
             texts: list[str] | None = None) -> Windows:
    """`n_train` training and `n_val` validation windows of one source (`from_source`)."""
    if texts is None:
        texts = data.load_texts(data.TextSource(source, spec.split, spec.text_column, spec.name))
    every = data.token_windows(tokenizer, texts, spec.length, bos=True)
    g = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(len(every), generator=g)
    if len(every) < n_val + spec.batch_size:
        raise RecoveryError(f"recovery.data: {source} has {len(every)} windows of {spec.length} tokens, fewer "
                            f"than one batch ({spec.batch_size}) plus the validation slice ({n_val})")
    val, pool = order[:n_val], order[n_val:]
    reps = math.ceil(n_train / len(pool))
    train = torch.cat([pool[torch.randperm(len(pool), generator=g)] for _ in range(reps)] or [pool[:0]])[:n_train]

    def pick(i):
        return data.TokenBatch(every.input_ids[i], every.attention_mask[i])

    return Windows(pick(train), pick(val), source, round(n_train / len(pool), 3))


GENERATE_BYTES = 1 << 30  # one generation batch's KV cache and per-step logits, at most (at least one window)
MAX_GENERATE_BATCH = 256  # windows at a time: no faster beyond on the CPU (MiniLM: 128 as fast as 256, 64 slower)


def draw(logits: torch.Tensor, u: torch.Tensor, temperature: float = 1.0, block: int = 256) -> torch.Tensor:
    """One token per row of `logits` (b, V) from softmax(logits / temperature), by the inverse of the cumulative
    distribution at `u` (b,), uniform in [0, 1). (b,)

    One uniform number a token instead of `torch.multinomial`'s V exponential ones (256 rows of a 30k
    vocabulary, one CPU thread: 46 ms against 205 ms, eval/bench/generation.py), in two levels: a `block` of the
    vocabulary is chosen by the cumulative sums of the blocks' probabilities, then the token inside it by the
    cumulative sums of its own, at the same uniform's place inside the block. Each sum is of float32
    probabilities exact to float32's relative rounding, summed over at most `block` of them, and accumulated in
    float64: a token is drawn with its probability to float32's relative precision, as in the logits themselves
    (one inverse CDF over the whole vocabulary in float32 would be off by float32's rounding of the running
    total, ~1e-7 absolute for every token); a token of probability 0 never is.
    """
    b, V = logits.shape
    p = torch.softmax(logits.float() / temperature, -1)                                  # (b, V), on its device
    full = V - V % block
    sums = p[:, :full].view(b, -1, block).sum(-1)                                        # (b, V // block)
    if full < V:
        sums = torch.cat([sums, p[:, full:].sum(-1, keepdim=True)], 1)                   # (b, blocks)
    ends = sums.cpu().double().cumsum(-1)               # (b, blocks); the rest on the CPU (float64 everywhere)
    at = u.double()[:, None] * ends[:, -1:]                                              # (b, 1)
    j = torch.searchsorted(ends, at, right=True).clamp_max(ends.shape[1] - 1)            # (b, 1): the block
    start = torch.where(j > 0, ends.gather(1, (j - 1).clamp_min(0)), 0.0)                # (b, 1)
    frac = (at - start) / (ends.gather(1, j) - start)                                    # (b, 1), in [0, 1)
    idx = j * block + torch.arange(block)                                                # (b, block)
    inside = p.gather(1, idx.clamp_max(V - 1).to(p.device)).cpu().double() * (idx < V)  # (b, block)
    k = torch.searchsorted(inside.cumsum(-1), frac * inside.sum(-1, keepdim=True), right=True)
    return (j * block + k.clamp_max(block - 1))[:, 0].clamp_max(V - 1)


def generation_batch(teacher, length: int, n: int) -> int:
    """Windows sampled at a time: as many as keep their KV cache and one step's logits (float32, and the float64
    sums of `draw`) within GENERATE_BYTES, at most MAX_GENERATE_BATCH and n."""
    g = arch.geometry(teacher)
    itemsize = next(teacher.parameters()).element_size()
    per_window = g.n_layers * 2 * g.n_kv_heads * g.head_dim * itemsize * length + 12 * teacher.config.vocab_size
    return max(1, min(n, MAX_GENERATE_BATCH, GENERATE_BYTES // per_window))


@torch.no_grad()
def sample(teacher, start: int, n: int, length: int, seed: int, temperature: float = 1.0,
           batch_size: int | None = None, progress: bool = False) -> torch.Tensor:
    """`n` windows of `length` tokens sampled from `teacher` after the token `start`, seeded. (n, length)

    The uniform numbers `draw` turns into tokens are drawn first, a row per window, so window i's text depends
    on the seed and i alone, not on how many windows are sampled at a time (`batch_size`, default
    `generation_batch`) -- up to the float rounding of the logits a batch's shape can change.
    """
    u = torch.rand(n, length - 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    batch_size = batch_size or generation_batch(teacher, length, n)
    device = next(teacher.parameters()).device
    name = "cache" if "cache" in runtime.forward_parameters(type(teacher)) else "past_key_values"  # 5.x renamed it
    out = []
    bar = tqdm(total=n * (length - 1), desc="generating recovery text", unit="tok", disable=not progress)
    for i in range(0, n, batch_size):
        b = min(batch_size, n - i)
        ids = torch.full((b, length), start, dtype=torch.long)                                  # (b, length)
        cache = None
        for t in range(length - 1):
            o = teacher(input_ids=ids[:, t:t + 1].to(device), use_cache=True, **{name: cache})
            cache = getattr(o, name)
            ids[:, t + 1] = draw(o.logits[:, -1], u[i:i + b, t], temperature)
            bar.update(b)
        out.append(ids)
    bar.close()
    return torch.cat(out)


def cache_key(identity: dict, spec: RecoverySpec, n: int) -> str:
    """The name of a generated set: the teacher's identity, the seed, the shape, the sampling temperature and the
    sampler (a set an earlier sampler left in a run folder is not read as this one's)."""
    what = {"teacher": identity, "seed": spec.seed, "length": spec.length, "n": n,
            "temperature": spec.temperature_generate, "sampler": "inverse-cdf"}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def generated(spec: RecoverySpec, teacher, tokenizer, n_train: int, n_val: int, cache: Path | None,
              identity: dict, progress: bool = False) -> Windows:
    """The teacher's own text, read from `cache` (a folder) when an earlier recovery left it there."""
    n = n_train + n_val
    path = None if cache is None else Path(cache) / f"generated-{cache_key(identity, spec, n)}.pt"
    if path is not None and path.exists():
        ids = torch.load(path, weights_only=True)
    else:
        ids = sample(teacher, data.bos_token_id(tokenizer), n, spec.length, spec.seed,
                     spec.temperature_generate, progress=progress)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # several processes write the same windows
            torch.save(ids, tmp)
            tmp.replace(path)

    def batch(x):
        return data.TokenBatch(x, torch.ones_like(x))

    return Windows(batch(ids[n_val:]), batch(ids[:n_val]), GENERATED, 1.0)
