"""Per-output-channel moments of each head: what scoring and compensation read through W_O."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pruner.core.precision import matmul_precision

Tensor = torch.Tensor


@dataclass
class OutputMoments:
    """First and second moments of each head's output, split by channel (sums, float64).

    Per query row a head writes o = u + w (before the output projection), with
    u = sum_{j in S} a_j v_j the sink channel and w = sum_{j in C} a_j v_j the
    content channel. Keeping sums of o, u, w and of their outer products lets any
    quadratic form through W_O (output norms, fluctuation around the mean, the
    part of it each channel carries) be computed later, exactly.
    `joint` is the second moment of all heads' outputs together, so the energy of
    pruning several heads of a layer at once (their cross terms) is exact too.
    Shapes: tokens (); o, u, w: (head, d_head); oo, uu, ww: (head, d_head, d_head) -- uu and ww
    empty (0,) unless captured with `CaptureConfig(channels=True)`; joint: (head * d_head, head * d_head),
    empty (0,) when captured with `CaptureConfig(joint=False)` (no stage reads it).
    """

    tokens: Tensor
    o: Tensor
    u: Tensor
    w: Tensor
    oo: Tensor
    uu: Tensor
    ww: Tensor
    joint: Tensor

    def __add__(self, other: "OutputMoments") -> "OutputMoments":
        return OutputMoments(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def add_(self, other: "OutputMoments") -> "OutputMoments":
        """`self += other` in place: a layer's running sums take a batch's without a third copy of either."""
        for f in fields(self):
            getattr(self, f.name).add_(getattr(other, f.name))
        return self

    def to(self, device, non_blocking: bool = False) -> "OutputMoments":
        return OutputMoments(*(getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)))

    def completed(self, folds: "FoldMoments | None") -> "OutputMoments":
        """With fold moments captured, the joint moment is their sum and each head's `oo` its diagonal block: derived
        here once the layer's sums are final, instead of a joint kept beside the folds for every batch."""
        if folds is None or self.has_joint:
            return self
        H, D = self.o.shape
        joint = folds.joint.sum(0)  # (H*d, H*d)
        oo = torch.diagonal(joint.view(H, D, H, D), dim1=0, dim2=2).permute(2, 0, 1).contiguous()  # (H, d, d)
        return OutputMoments(self.tokens, self.o, self.u, self.w, oo, self.uu, self.ww, joint)

    @property
    def has_joint(self) -> bool:
        return bool(self.joint.numel())

    def first_moments(self) -> "OutputMoments":
        """The token count and the sums of o, u and w alone (second moments empty): what the stages after selection
        read of a layer (mean compensation, reports) once its selection curve is built (docs/design.md §8.4)."""
        none = self.o.new_zeros(0)
        return OutputMoments(self.tokens, self.o, self.u, self.w, none, none, none, none)


@dataclass
class FoldMoments:
    """One layer's head-output sums per calibration fold (whole samples, sample i in fold i mod K), float64.

    What cross-validating refit's ridge needs (`pruner.pruning.refit.choose_ridge`): any
    training set is the total minus one fold, any held-out set one fold. Shapes: tokens (K,),
    o (K, D), joint (K, D, D), D = heads * d_head. K x the joint's memory: ridge `auto` costs that.
    """

    tokens: Tensor
    o: Tensor
    joint: Tensor

    def __add__(self, other: "FoldMoments") -> "FoldMoments":
        return FoldMoments(self.tokens + other.tokens, self.o + other.o, self.joint + other.joint)

    def add_(self, other: "FoldMoments") -> "FoldMoments":
        for a, b in ((self.tokens, other.tokens), (self.o, other.o), (self.joint, other.joint)):
            a.add_(b)
        return self

    def to(self, device, non_blocking: bool = False) -> "FoldMoments":
        return FoldMoments(*(x.to(device, non_blocking=non_blocking) for x in (self.tokens, self.o, self.joint)))


def fold_moments(o: Tensor, rows: Tensor, folds: Tensor, n_folds: int, bf16: bool = False,
                 into: FoldMoments | None = None) -> FoldMoments:
    """`FoldMoments` of one batch: o (B, T, H, d_head); rows (B, T) counted rows; folds (B,) each sample's fold.

    Each fold's rows are centred on their own mean in float32 and uncentred in float64, as
    `output_moments` does for the whole batch; the whole batch's sums are their sum. With `into` (a layer's
    running fold sums) each fold's are added to it in place and `into` is returned: no batch copy of the
    K x (H d_head)^2 sums beside the running ones.
    """
    B, T, H, D = o.shape
    x = o.reshape(B * T, H * D)
    keep = rows.reshape(-1).bool()
    of_row = folds.to(o.device).repeat_interleave(T)  # (B * T,)
    if into is None:
        into = FoldMoments(torch.zeros(n_folds, dtype=torch.float64, device=o.device),
                           torch.zeros(n_folds, H * D, dtype=torch.float64, device=o.device),
                           torch.zeros(n_folds, H * D, H * D, dtype=torch.float64, device=o.device))
    for f in range(n_folds):
        xf = x[keep & (of_row == f)].float()  # (N_f, H * d_head)
        if not len(xf):
            continue
        n, total = float(len(xf)), xf.sum(0, dtype=torch.float64)
        ref = (total / n).float()
        with matmul_precision(bf16):
            c = gram(xf - ref, H)
        r = ref.double()
        t = total - (n / 2) * r  # sum x x^T = sum xc xc^T + r t^T + t r^T, t = sum (x - r) + n r / 2
        into.tokens[f] += n
        into.o[f] += total
        into.joint[f] += c.double().addr_(r, t).addr_(t, r)
    return into


def output_moments(o: Tensor, u: Tensor, rows: Tensor, bf16: bool = False,
                   folds: FoldMoments | None = None, channels: bool = True, joint: bool = True) -> OutputMoments:
    """Moments of one layer's head outputs over the counted rows of a batch.

    o: (B, T, H, d_head) what the output projection receives (any float dtype);
    u: (B, T, H, d_head) float32, its sink channel; rows: (B, T) rows to count.
    The products run in float32 on values centred on their batch mean and are
    uncentred in float64: the sink channel writes nearly the same vector on every
    row, so raw second moments are dominated by mean x mean^T and a float32 product
    of raw values would lose the fluctuation that scoring and refit read. `joint`
    costs (B * T) x (H * d_head)^2, as much as the output projection itself, so it is
    computed on the upper block triangle only (`gram`); with `bf16` (a bfloat16 model)
    its products run in reduced precision (`matmul_precision`), rounding the centred
    values by at most 2^-9, no more than the model rounded o itself. With `folds` (fold moments
    captured), `joint` and `oo` are left empty: they are the folds' sum and its diagonal blocks, derived once
    the layer's sums are final (`OutputMoments.completed`), not kept beside the folds for every batch. Without
    `channels`, the per-channel second moments `uu` and `ww` are not computed (empty tensors):
    what no shipped scorer or compensation reads costs neither time nor memory. Without `joint`
    (no refit, no refit-aware or sink-aware scorer reads it) the (H d_head)^2 joint moment is an
    empty tensor too, and each head's own `oo` is computed alone: H d_head^2 per row, not (H d_head)^2.
    """
    B, T, H, D = o.shape
    N = B * T
    r = rows.reshape(N, 1).to(torch.float32)  # 0/1 row weights: pad rows are zeroed, not selected out
    every = bool(r.all())
    x = o.reshape(N, H * D)
    uf = u.reshape(N, H * D)
    n = r.sum(dtype=torch.float64)
    # float64 sums (their rounding does not depend on the thread count); the means centre the products
    o_sum, u_sum = ((y if every else y * r).sum(0, dtype=torch.float64) for y in (x, uf))
    ref_o, ref_u = (o_sum / n).float(), (u_sum / n).float()
    xc = x.float() - ref_o  # (N, H * d_head)
    if not every:
        xc.mul_(r)
    if folds is not None and not joint:
        raise ValueError("fold moments are joint moments: output_moments(folds=...) needs joint=True")
    o_sum, u_sum = o_sum.view(H, D), u_sum.view(H, D)
    w_sum = o_sum - u_sum
    oo, joint = _second_moments(xc, o_sum, ref_o, n, bf16, folds is not None, joint)
    if not channels:  # the channels' centred copies are never made
        none = torch.zeros(0, dtype=torch.float64, device=joint.device)
        return OutputMoments(n, o_sum, u_sum, w_sum, oo, none, none.clone(), joint)
    uu, ww = _channels(xc.view(N, H, D), uf.view(N, H, D), r if not every else None, (u_sum, ref_u.view(H, D)),
                       (w_sum, (ref_o - ref_u).view(H, D)), n)
    return OutputMoments(n, o_sum, u_sum, w_sum, oo, uu, ww, joint)


def _second_moments(xc: Tensor, o_sum: Tensor, ref_o: Tensor, n: Tensor, bf16: bool, from_folds: bool,
                    joint: bool) -> tuple[Tensor, Tensor]:
    """(oo (H, d, d), joint (H d, H d)), float64, uncentred from the centred float32 outputs `xc` (N, H d) with
    their sums `o_sum` (H, d) and centre `ref_o` (H d,). `from_folds`: both empty, derived from the folds once the
    layer is complete; without `joint`, joint empty and each head's own block computed alone."""
    H, D = o_sum.shape
    if from_folds:
        oo, joint = (torch.zeros(0, dtype=torch.float64, device=xc.device) for _ in range(2))
        return oo, joint
    if joint:
        with matmul_precision(bf16):
            joint_c = gram(xc, H)
        joint = uncentre(joint_c, o_sum.view(-1), ref_o, n)  # (H*d, H*d)
        oo = torch.diagonal(joint.view(H, D, H, D), dim1=0, dim2=2).permute(2, 0, 1).contiguous()  # (H, d, d)
        return oo, joint
    with matmul_precision(bf16):  # each head's own block only, from the same centred float32 values
        oo = uncentre(head_grams(xc.view(xc.shape[0], H, D)), o_sum, ref_o.view(H, D), n)
    return oo, torch.zeros(0, dtype=torch.float64, device=oo.device)


def _channels(xc: Tensor, u: Tensor, r: Tensor | None, u_ref: tuple[Tensor, Tensor], w_ref: tuple[Tensor, Tensor],
              n: Tensor) -> tuple[Tensor, Tensor]:
    """Each head's sink- and content-channel second moments (H, d, d), float64: xc (N, H, d) the centred outputs,
    u (N, H, d) the sink channel, r (N, 1) the row weights (None: every row counts), each reference a (sum, mean)
    pair; the content channel w = o - u is centred on the difference of the two means."""
    uc = u - u_ref[1]
    if r is not None:
        uc.mul_(r.unsqueeze(-1))
    wc = xc - uc

    def per_head(y):
        return torch.bmm(y.permute(1, 2, 0), y.transpose(0, 1))  # (H, d_head, d_head)

    return uncentre(per_head(uc), *u_ref, n), uncentre(per_head(wc), *w_ref, n)


def uncentre(c: Tensor, total: Tensor, ref: Tensor, n: Tensor) -> Tensor:
    """sum x x^T from the centred sum c = sum (x - r)(x - r)^T over n rows: with s = sum (x - r) and
    t = s + n r / 2, sum xc xc^T + r s^T + s r^T + n r r^T = sum xc xc^T + r t^T + t r^T. c: (D, D) or a batch
    (H, D, D) with total and ref (D,) or (H, D); float64 out."""
    r = ref.double()
    t = total - (n / 2) * r
    out = c.double()
    if out.dim() == 2:
        return out.addr_(r, t).addr_(t, r)
    return out.baddbmm_(r.unsqueeze(-1), t.unsqueeze(-2)).baddbmm_(t.unsqueeze(-1), r.unsqueeze(-2))


def head_grams(x: Tensor, rows: int = 512) -> Tensor:
    """Each head's x_h^T x_h for x (N, H, d): (H, d, d), float32, summed over blocks of `rows` rows in order
    (as `gram`, so that the result does not depend on how many threads the product is split over)."""
    N, H, D = x.shape
    out = x.new_zeros(H, D, D)
    for r0 in range(0, N, rows):
        xr = x[r0:r0 + rows].transpose(0, 1)  # (H, rows, d)
        out.baddbmm_(xr.transpose(1, 2), xr)
    return out


def gram(x: Tensor, heads: int, rows: int = 512) -> Tensor:
    """x^T x for x (N, F), float32: the upper block triangle only (F split into <= 4 blocks at head
    boundaries: 10/16 of the multiply-adds), mirrored.

    Summed over blocks of `rows` rows in order: BLAS libraries split a long inner
    dimension across threads (MKL here: from 1024 rows for a 64-column block, never at
    512 for 32 to 2048 columns), which
    would make the result, and the plans scored from it, depend on the thread count.
    """
    F = x.shape[1]
    nb = min(4, heads)
    edges = [F * (heads * i // nb) // heads for i in range(nb + 1)]
    out = x.new_zeros(F, F)
    for r0 in range(0, x.shape[0], rows):
        xr = x[r0:r0 + rows]
        for a, b in zip(edges[:-1], edges[1:]):
            out[a:b, a:].addmm_(xr[:, a:b].t(), xr[:, a:])
    for a, b in zip(edges[:-1], edges[1:]):
        out[b:, a:b] = out[a:b, b:].t()
    return out
