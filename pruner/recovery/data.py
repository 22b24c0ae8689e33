"""The recovery tokens: windows of a data source the recipes accept, or text the teacher samples itself.

`generated` needs nothing beyond the model (self-data distillation): every window starts
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
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pruner.core import assets, data
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
    """Refuse a recovery source that is (or contains, or lies in) the run's evaluation text (`evaluation`: the
    recipe's evaluation section)."""
    if spec.data == GENERATED:
        return
    same = (spec.data, spec.name, spec.split) == (evaluation.data, evaluation.name, evaluation.split)
    a, b = _local(spec.data), _local(evaluation.data)
    if not same and a is not None and b is not None:
        same = a == b or a in b.parents or b in a.parents
    if same:
        raise RecoveryError(f"recovery.data: {spec.data} overlaps the evaluation windows ({evaluation.data}), "
                            "which recovery never trains on; use another source (e.g. shakespeare:train) or "
                            "the default, generated")


def from_source(spec: RecoverySpec, tokenizer, n_train: int, n_val: int, texts: list[str] | None = None) -> Windows:
    """Windows of a data source (or of `texts` given in memory), shuffled by the seed; the validation slice first,
    the budget cycling over the rest when the source is shorter than the budget."""
    if texts is None:
        texts = data.load_texts(data.TextSource(spec.data, spec.split, spec.text_column, spec.name))
    every = data.token_windows(tokenizer, texts, spec.length, bos=True)
    g = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(len(every), generator=g)
    if len(every) < n_val + spec.batch_size:
        raise RecoveryError(f"recovery.data: {spec.data} has {len(every)} windows of {spec.length} tokens, fewer "
                            f"than one batch ({spec.batch_size}) plus the validation slice ({n_val})")
    val, pool = order[:n_val], order[n_val:]
    reps = math.ceil(n_train / len(pool))
    train = torch.cat([pool[torch.randperm(len(pool), generator=g)] for _ in range(reps)])[:n_train]
    pick = lambda i: data.TokenBatch(every.input_ids[i], every.attention_mask[i])  # noqa: E731
    return Windows(pick(train), pick(val), spec.data, round(n_train / len(pool), 3))


@torch.no_grad()
def sample(teacher, start: int, n: int, length: int, seed: int, temperature: float = 1.0,
           batch_size: int = 64, progress: bool = False) -> torch.Tensor:
    """`n` windows of `length` tokens sampled from `teacher` after the token `start`, seeded. (n, length)"""
    g = torch.Generator().manual_seed(seed)
    device = next(teacher.parameters()).device
    out = []
    bar = tqdm(total=n * (length - 1), desc="generating recovery text", unit="tok", disable=not progress)
    for i in range(0, n, batch_size):
        ids = torch.full((min(batch_size, n - i), 1), start, dtype=torch.long, device=device)  # (b, 1)
        cache, step = None, ids
        for _ in range(length - 1):
            with warnings.catch_warnings():  # transformers 5.x renames the cache argument; both read it
                warnings.simplefilter("ignore", FutureWarning)
                o = teacher(input_ids=step, past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            probs = torch.softmax(o.logits[:, -1].float().cpu() / temperature, dim=-1)  # (b, V)
            step = torch.multinomial(probs, 1, generator=g).to(device)                  # (b, 1)
            ids = torch.cat([ids, step], dim=1)
            bar.update(ids.shape[0])
        out.append(ids.cpu())
    bar.close()
    return torch.cat(out)


def cache_key(identity: dict, spec: RecoverySpec, n: int) -> str:
    """The name of a generated set: the teacher's identity, the seed, the shape and the sampling temperature."""
    what = {"teacher": identity, "seed": spec.seed, "length": spec.length, "n": n,
            "temperature": spec.temperature_generate}
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
    batch = lambda x: data.TokenBatch(x, torch.ones_like(x))  # noqa: E731
    return Windows(batch(ids[n_val:]), batch(ids[:n_val]), GENERATED, 1.0)
