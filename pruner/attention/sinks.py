"""Which keys are sinks: a sink specification turned into a (batch, k_pos) mask.

Modes (docs/design.md §2):

- `first`     -- the first non-pad token of each sequence (decoder default);
- `bos`       -- every BOS token (falls back to `[CLS]` for BERT-style tokenizers);
- `special`   -- every special token of the tokenizer except padding (`[CLS]`,
                 `[SEP]`, BOS, EOS; encoder default);
- `ids`       -- explicit token ids;
- `positions` -- explicit positions, counted from the first non-pad token;
- `auto`      -- data-driven: the positions and token ids whose mean received
                 attention (over layers, heads and the query rows that can see
                 them) exceeds `eps` (default 0.3, as Gu et al. 2025's Sink_eps);
                 resolved once on calibration data into a `positions`/`ids` spec.

Positions count from the first non-pad token so that left padding never moves
a sink: padding must not change any statistic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MODES = ("first", "bos", "special", "ids", "positions", "auto")


@dataclass(frozen=True)
class SinkSpec:
    """A validated sink specification."""

    mode: str = "first"
    ids: tuple[int, ...] = field(default_factory=tuple)
    positions: tuple[int, ...] = field(default_factory=tuple)
    eps: float = 0.3

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown sink mode {self.mode!r}; valid: {', '.join(MODES)}")
        if self.mode == "ids" and not self.ids:
            raise ValueError("sink mode 'ids' needs at least one token id")
        if self.mode == "positions" and not self.positions:
            raise ValueError("sink mode 'positions' needs at least one position")
        if any(p < 0 for p in self.positions):
            raise ValueError(f"sink positions must be >= 0, got {list(self.positions)}")
        if not 0 < self.eps < 1:
            raise ValueError(f"sink eps must be in (0, 1), got {self.eps}")


def default_spec(causal: bool) -> SinkSpec:
    """`first` for decoders, `special` (`[CLS]`/`[SEP]`) for encoders."""
    return SinkSpec("first" if causal else "special")


def parse_spec(text: str | None, causal: bool) -> SinkSpec:
    """`first`, `bos`, `special`, `auto`, `ids:1,2` or `positions:0,1` (None: the default for the model)."""
    if text is None:
        return default_spec(causal)
    mode, _, values = text.partition(":")
    try:
        nums = tuple(int(v) for v in values.split(",") if v.strip()) if values else ()
    except ValueError:
        raise ValueError(f"invalid sink spec {text!r}: values must be whole numbers, e.g. ids:101,102 "
                         "or positions:0,1") from None
    if mode == "ids":
        return SinkSpec("ids", ids=nums)
    if mode == "positions":
        return SinkSpec("positions", positions=nums)
    if values:
        raise ValueError(f"sink mode {mode!r} takes no values")
    return SinkSpec(mode)


def relative_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token counted from the first non-pad token. (batch, k_pos); pads < 0."""
    mask = attention_mask.bool()
    first = mask.float().argmax(dim=1, keepdim=True)  # (B, 1) index of the first real token
    pos = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) - first
    return torch.where(mask, pos, torch.full_like(pos, -1))


def token_ids_for(spec: SinkSpec, tokenizer) -> list[int]:
    """The token ids a token-based mode marks as sinks."""
    if spec.mode == "ids":
        return list(spec.ids)
    if spec.mode == "bos":
        tok_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
        if tok_id is None:
            raise ValueError("sink mode 'bos': the tokenizer has neither a BOS nor a CLS token")
        return [int(tok_id)]
    if spec.mode == "special":
        ids = [i for i in tokenizer.all_special_ids if i != tokenizer.pad_token_id]
        if not ids:
            raise ValueError("sink mode 'special': the tokenizer has no special tokens")
        return ids
    return []


def sink_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor, spec: SinkSpec,
              tokenizer=None) -> torch.Tensor:
    """Boolean (batch, k_pos): True at sink keys (never at padding)."""
    if spec.mode == "auto":
        raise ValueError("sink mode 'auto' must be resolved on data first (pruner.attention.capture.resolve_auto_sinks)")
    valid = attention_mask.bool()
    if spec.mode == "first":
        return valid & (relative_positions(attention_mask) == 0)
    mask = torch.zeros_like(valid)
    if spec.positions:
        rel = relative_positions(attention_mask)
        mask |= torch.isin(rel, torch.tensor(spec.positions, device=rel.device))
    ids = token_ids_for(spec, tokenizer) if spec.mode in ("bos", "special") else list(spec.ids)
    if ids:
        mask |= torch.isin(input_ids, torch.tensor(ids, dtype=input_ids.dtype, device=input_ids.device))
    return mask & valid


def check_content(input_ids: torch.Tensor, attention_mask: torch.Tensor, spec: SinkSpec, tokenizer=None) -> None:
    """Refuse a sink spec that marks every real token as a sink: no query row would be measured."""
    if spec.mode == "auto":
        return
    if not (attention_mask.bool() & ~sink_mask(input_ids, attention_mask, spec, tokenizer)).any():
        raise ValueError(f"sink spec {spec.mode!r} marks every token of every sample as a sink, so no "
                         "attention row has content keys to measure; choose fewer sinks")
