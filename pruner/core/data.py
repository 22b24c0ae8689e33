"""Text -> token batches, offline first.

Two sample shapes cover every use in pruner:

- **windows** (decoders): the documents are tokenised, joined with the EOS token
  and cut into non-overlapping windows of a fixed length; optionally the BOS token
  starts every window (the sink most decoders rely on is whatever starts the
  window, so it is a choice the user must be able to make explicitly).
- **lines** (encoders): every non-empty line is one sample, tokenised with the
  tokenizer's own special tokens (`[CLS] ... [SEP]`) and truncated.

Sampling is seeded and deterministic: the same source, tokenizer and seed give
the same samples in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from pruner.core import assets, package_docs_text, python_docs_text


class DataError(ValueError):
    """Input text that cannot give the samples asked for."""


@dataclass(frozen=True)
class TextSource:
    """Where text comes from: a local file/folder, a shipped split, or a Hub dataset.

    `path` is tried in this order: `shakespeare:<split>` (shipped corpus),
    `python-docs:<dev|evaluation>` (the standard library's docstrings, `pruner.core.python_docs_text`),
    `package-docs:<dev|evaluation>` (pruner's dependencies' READMEs, `pruner.core.package_docs_text`), an
    existing local file or folder (every `*.txt` inside, sorted), otherwise a Hub
    dataset id loaded with `datasets.load_dataset(path, name, split=split)`.
    """

    path: str = "shakespeare:calibration"
    split: str = "train"  # Hub datasets only
    text_column: str = "text"  # Hub datasets only
    name: str | None = None  # Hub dataset config name


@dataclass(frozen=True)
class TokenBatch:
    """Padded token ids. input_ids, attention_mask: (batch, q_pos)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batches(self, batch_size: int) -> Iterator["TokenBatch"]:
        """Consecutive slices of at most `batch_size` samples."""
        for i in range(0, len(self), batch_size):
            yield TokenBatch(self.input_ids[i:i + batch_size], self.attention_mask[i:i + batch_size])


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise DataError(f"no .txt files in folder {path}")
    return files


def load_texts(source: TextSource) -> list[str]:
    """Documents of a source: one per local file, one per Hub dataset row."""
    from datasets import load_dataset

    path = source.path
    if path.startswith(python_docs_text.PREFIX):  # the running Python's standard-library docstrings
        return list(python_docs_text.texts(path.removeprefix(python_docs_text.PREFIX)))
    if path.startswith(package_docs_text.PREFIX):  # the installed dependencies' long descriptions
        return list(package_docs_text.texts(path.removeprefix(package_docs_text.PREFIX)))
    if path.startswith("shakespeare:"):
        path = str(assets.shakespeare(path.split(":", 1)[1]))
    local = Path(path).expanduser()
    if local.exists():
        files = _local_files(local)
        for f in files:  # a clear message beats a UnicodeDecodeError deep in `datasets`
            try:
                f.read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{f} is not UTF-8 text (byte {e.start}): re-encode it as UTF-8") from None
        ds = load_dataset("text", data_files=[str(f) for f in files], sample_by="document", split="train")
        texts = list(ds["text"])
    else:
        ds = load_dataset(path, source.name, split=source.split)
        if source.text_column not in ds.column_names:
            raise DataError(f"dataset {path!r} has no column {source.text_column!r}; "
                            f"columns: {', '.join(ds.column_names)}")
        texts = list(ds[source.text_column])
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise DataError(f"no text in {source.path!r}")
    return texts


SHIPPED_KINDS = {"shakespeare:": assets.SPLITS, python_docs_text.PREFIX: python_docs_text.SPLITS,
                 package_docs_text.PREFIX: package_docs_text.SPLITS}


def check_source(path: str) -> str:
    """`path` if it can name text: a shipped kind with one of its splits, an existing file or folder, or a Hub
    dataset id (no colon). Anything else is refused in one line before any text is read."""
    for prefix, splits in SHIPPED_KINDS.items():
        if path.startswith(prefix):
            if path.removeprefix(prefix) not in splits:
                raise DataError(f"unknown source {path!r}: {prefix.rstrip(':')} has the splits {', '.join(splits)}")
            return path
    if ":" in path and not Path(path).expanduser().exists():
        raise DataError(f"unknown source {path!r}: not a file or folder, and not one of "
                        f"{', '.join(k + '<split>' for k in SHIPPED_KINDS)} (Hub dataset ids have no colon)")
    return path


def bos_token_id(tokenizer) -> int:
    """The token that starts a window: BOS, else `[CLS]` (BERT used as a decoder)."""
    for tok_id in (tokenizer.bos_token_id, tokenizer.cls_token_id):
        if tok_id is not None:
            return int(tok_id)
    raise DataError(f"tokenizer {type(tokenizer).__name__} has neither a BOS nor a CLS token to start windows "
                    "with; set bos: false in the recipe's calibration and evaluation sections "
                    "(--no-bos for pruner sinks)")


def _sample(n_total: int, num_samples: int | None, seed: int) -> list[int]:
    """Indices of `num_samples` of `n_total` items, seeded, in increasing order."""
    if num_samples is None or num_samples >= n_total:
        return list(range(n_total))
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(n_total, generator=g)[:num_samples].tolist())


def token_windows(tokenizer, texts: Sequence[str], length: int, *, bos: bool = True,
                  num_samples: int | None = None, seed: int = 0) -> TokenBatch:
    """Non-overlapping windows of exactly `length` tokens (BOS included when `bos`).

    Documents are joined with EOS (when the tokenizer has one) so no window
    silently glues two texts together. input_ids: (window, q_pos).
    """
    if length < 2:
        raise DataError(f"window length must be >= 2, got {length}")
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if sep is not None:
            stream.append(int(sep))
    body = length - 1 if bos else length
    n_windows = len(stream) // body
    if n_windows == 0:
        raise DataError(f"text has {len(stream)} tokens, shorter than one window of {body} tokens")
    ids = torch.tensor(stream[: n_windows * body], dtype=torch.long).view(n_windows, body)
    ids = ids[_sample(n_windows, num_samples, seed)]
    if bos:
        ids = torch.cat([torch.full((len(ids), 1), bos_token_id(tokenizer)), ids], dim=1)
    return TokenBatch(ids, torch.ones_like(ids))


def line_samples(tokenizer, texts: Sequence[str], max_length: int, *, num_samples: int | None = None,
                 seed: int = 0, min_tokens: int = 4, padding_side: str = "right") -> TokenBatch:
    """Each non-empty line with >= `min_tokens` tokens is a sample, truncated to `max_length`.

    The tokenizer adds its own special tokens (`[CLS] ... [SEP]` for BERT), so the
    encoder sees exactly what it was trained on. input_ids: (line, q_pos), padded.
    """
    lines = [ln.strip() for text in texts for ln in text.splitlines() if ln.strip()]
    encoded = [tokenizer(ln, truncation=True, max_length=max_length)["input_ids"] for ln in lines]
    encoded = [e for e in encoded if len(e) >= min_tokens]
    if not encoded:
        raise DataError(f"no line has at least {min_tokens} tokens")
    encoded = [encoded[i] for i in _sample(len(encoded), num_samples, seed)]
    return pad(encoded, pad_id=tokenizer.pad_token_id or 0, side=padding_side)


def samples(tokenizer, texts: Sequence[str], unit: str, length: int, *, bos: bool = True,
            num_samples: int | None = None, seed: int = 0) -> TokenBatch:
    """`unit` "windows" (`token_windows`, decoders) or "lines" (`line_samples`, encoders) of `length` tokens."""
    if unit == "windows":
        return token_windows(tokenizer, texts, length, bos=bos, num_samples=num_samples, seed=seed)
    if unit == "lines":
        return line_samples(tokenizer, texts, length, num_samples=num_samples, seed=seed)
    raise ValueError(f"unknown sample unit {unit!r}; valid: windows, lines")


def pad(samples: Sequence[Sequence[int]], pad_id: int, side: str = "right") -> TokenBatch:
    """Pad ragged token lists to one (sample, q_pos) tensor with its attention mask."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        sl = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = 1
    return TokenBatch(ids, mask)


def mask_tokens(ids: torch.Tensor, attention_mask: torch.Tensor, tokenizer, prob: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: `prob` of the non-special tokens are targets (80% [MASK], 10% random, 10% kept).

    ids, attention_mask: (sample, q_pos). Returns (masked ids, labels with -100 off-target).
    """
    special = torch.zeros_like(ids, dtype=torch.bool)
    for s in tokenizer.all_special_ids:
        special |= ids == s
    candidates = (attention_mask.bool() & ~special)
    target = (torch.rand(ids.shape, generator=generator) < prob) & candidates
    labels = torch.where(target, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=generator)
    x = ids.clone()
    x[target & (roll < 0.8)] = tokenizer.mask_token_id
    rand = target & (roll >= 0.8) & (roll < 0.9)
    x[rand] = torch.randint(len(tokenizer), ids.shape, generator=generator)[rand]
    return x, labels
