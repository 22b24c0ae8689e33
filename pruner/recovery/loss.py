"""The distillation loss: token-level forward KL(teacher || student), in float32 whatever the models store.

Forward KL over the vocabulary at every real position is what Minitron and Model-Optimizer
distil with (logits only, temperature 1): the student is pulled towards every token the
teacher finds plausible, not only the one that happened to come next, so a few hundred
thousand tokens carry far more signal than the same text's cross-entropy. The sum over
positions is returned with the count of real positions, so several processes (or
batches) add their sums and divide once: the same mean as one process on the whole
batch.

`topk_kl` is the same divergence against a cached teacher that kept only its top-k
log-probabilities and the mass of the rest. Over the top k it is exact. The rest of the
vocabulary (the tail) is read one of two ways: collapsed to one bin in both distributions
(the exact KL of the collapsed distributions: a lower bound of the full one, blind to how
the student spreads its tail), or, when the cache also kept m tokens sampled from the
teacher's tail with their log-probabilities (`tail_samples`), as p_tail times the mean of
log p(y) - log q(y) over those samples: a Monte-Carlo estimate of the full KL's tail term
that is unbiased, so the loss and its gradient are the full-vocabulary KL's in expectation.
Without the samples a student can lower the collapsed KL while its tail drifts away from
the teacher's (docs/recovery.md: both held-out domains got worse).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, T, V) logits -> (B, T, V) float32 log-probabilities at `temperature`."""
    return F.log_softmax(logits.float() / temperature, dim=-1)


def full_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
            temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed KL(teacher || student) over real positions and their count.

    student_logits, teacher_logits: (B, T, V); mask: (B, T), 1 on real tokens. Returns
    (scalar float32 sum, scalar count). Scaled by T^2 (Hinton) so gradients keep their size
    whatever the temperature.
    """
    s = log_probs(student_logits, temperature)          # (B, T, V)
    t = log_probs(teacher_logits, temperature)          # (B, T, V)
    kl = (t.exp() * (t - s)).sum(-1)                   # (B, T)
    on = mask.to(kl.device, kl.dtype)
    return (kl * on).sum() * temperature ** 2, on.sum()


def topk_targets(teacher_logits: torch.Tensor, k: int, temperature: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the cached teacher keeps per position: its top-k log-probabilities (B, T, k) float32, their token
    ids (B, T, k) int32, and the log of the rest's mass (B, T) float32 (-inf when nothing is left)."""
    lp = log_probs(teacher_logits, temperature)
    top, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
    tail = torch.log1p(-top.exp().sum(-1).clamp(max=1.0))   # (B, T): log(1 - sum of the top-k)
    return top, idx.to(torch.int32), tail


def tail_samples(teacher_logits: torch.Tensor, idx: torch.Tensor, m: int, generator: torch.Generator,
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`m` tokens per position drawn (with replacement) from the teacher's distribution outside its top k
    (`idx`: (B, T, k)), and their teacher log-probabilities: (B, T, m) int32, (B, T, m) float32. A position
    whose tail is empty gets arbitrary tokens (its tail mass, the samples' weight, is 0)."""
    lp = log_probs(teacher_logits, temperature)                         # (B, T, V)
    p = lp.exp().scatter(-1, idx.long(), 0.0)                           # (B, T, V): the tail only
    B, T, V = p.shape
    flat = p.reshape(B * T, V)
    flat = torch.where(flat.sum(-1, keepdim=True) > 0, flat, torch.ones_like(flat))
    y = torch.multinomial(flat, m, replacement=True, generator=generator).reshape(B, T, m)
    return y.to(torch.int32), lp.gather(-1, y)


def topk_kl(student_logits: torch.Tensor, top: torch.Tensor, idx: torch.Tensor, tail: torch.Tensor,
            mask: torch.Tensor, temperature: float = 1.0,
            samples: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed KL of the teacher's top-k + tail distribution from the student's: the tail collapsed to one bin
    in both, or estimated from the teacher's tail `samples` ((B, T, m) ids and log-probabilities, from
    `tail_samples`) when given.

    student_logits: (B, T, V); top, idx: (B, T, k); tail, mask: (B, T). Returns (sum, count) as `full_kl`.
    """
    s = log_probs(student_logits, temperature)                          # (B, T, V)
    s_top = s.gather(-1, idx.long())                                    # (B, T, k)
    kl = (top.exp() * (top - s_top)).sum(-1)                            # (B, T)
    p_tail = tail.exp()
    if samples is None:
        s_tail = torch.log1p(-s_top.exp().sum(-1).clamp(max=1 - 1e-7))  # (B, T)
        per_token = tail - s_tail
    else:
        ids, lp = samples
        per_token = (lp - s.gather(-1, ids.long())).mean(-1)            # (B, T): mean log p(y) - log q(y)
    kl = kl + torch.where(p_tail > 0, p_tail * per_token, torch.zeros_like(kl))
    on = mask.to(kl.device, kl.dtype)
    return (kl * on).sum() * temperature ** 2, on.sum()


def next_token_ce(student_logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over real targets (the optional LM term). (B, T, V), (B, T) -> scalar."""
    logits = student_logits[:, :-1].float()
    target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100).to(logits.device)
    return F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="sum")
