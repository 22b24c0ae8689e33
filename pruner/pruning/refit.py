"""Refit compensation: the kept heads' output-projection columns take over what the pruned ones wrote.

Pure float64 tensor math (docs/design.md §8.1); `pruner.pruning.surgery` does the plumbing.

Per layer, x (D,) is the output projection's input (D = heads * d_head, the
concatenated head outputs), W (d_model, D) the projection, P / K the channels of
the pruned / kept heads. From calibration sums we have the mean mu = E[x] and the
second moment M = E[x x^T]. Pruning P with a refit replaces

    W_K <- W_K + W_P A^T,    A = (S_KK + lam I)^-1 S_KP,

the ridge regression of the pruned channels on the kept ones, so the layer keeps
writing W_P A^T x_K ~ W_P x_P:

- with an intercept (the projection has a bias), S is the covariance
  M - mu mu^T and the bias takes the constant, b <- b + W_P (mu_P - A^T mu_K);
  A = 0 is mean compensation, so refit is never worse on the calibration data;
- without one, S = M (uncentred) and the bias is untouched: the kept heads'
  sink channels (nearly the same vector for every query) play the constant.

What the kept heads cannot rebuild is the Schur-complement energy

    E(P) = tr(W_P (S_PP - S_PK (S_KK + lam I)^-1 S_KP) W_P^T),

the minimum of the ridge objective E||W_P (x_P - A^T x_K)||^2 + lam ||W_P A^T||_F^2:
the cost of pruning P under refit, which `System` evaluates for any P cheaply
from one inverse per layer.

lam = ridge x the mean diagonal of the layer's S: scale-free, fixed per layer (so the scorer and the fit
agree for every P), and it keeps S_KK + lam I positive definite whenever the layer writes anything. Kept heads
that write nothing have S_KP = 0, so A = 0 (mean compensation with an intercept, none without): never NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Tensor = torch.Tensor
MAX_CONDITION = 1e12  # beyond this the solve loses more than 4 of float64's 16 digits


class RefitError(ValueError):
    """A refit that cannot be computed reliably; the message says what to change."""


def second_moment(o: Tensor, joint: Tensor, tokens: Tensor | float, intercept: bool) -> tuple[Tensor, Tensor]:
    """(mu (D,), S (D, D)) from sums: S = covariance with an intercept, the uncentred moment without.

    o: (heads, d_head) or (D,) sum of x; joint: (D, D) sum of x x^T; tokens: count.
    """
    n = float(tokens)
    mu = o.reshape(-1).double() / n
    s = joint.double() / n  # in place from here: one (D, D) float64 matrix beside the sums, no other
    if intercept:
        s.addr_(mu, mu, alpha=-1)
    return mu, symmetrize_(s)  # exact symmetry: the sums are symmetric up to rounding


def symmetrize_(s: Tensor, rows: int = 256) -> Tensor:
    """(S + S^T) / 2 in place, `rows` rows at a time: no second (D, D) matrix. Returns `s`."""
    for i in range(0, s.shape[0], rows):
        avg = (s[i:i + rows, i:] + s[i:, i:i + rows].t()).mul_(0.5)  # (rows, D - i)
        s[i:i + rows, i:] = avg
        s[i:, i:i + rows] = avg.t()
    return s


def ridge_lambda(s: Tensor, ridge: float) -> float:
    """lam = ridge x mean diagonal of the layer's S (0 when the layer writes nothing)."""
    return ridge * float(torch.diagonal(s).mean().clamp_min(0))


TOKENS_PER_CHANNEL = 10  # below this many calibration tokens per channel a layer's refit leans on its ridge


def token_advice(tokens: int, channels: int) -> str | None:
    """A warning when a refit of `channels` output-projection channels per layer has fewer than
    `TOKENS_PER_CHANNEL` calibration tokens per channel (None when it has enough).

    Ridge regression of D channels on D - |P| others estimates a D x D second moment: with
    N tokens its noise shrinks like sqrt(D / N), so 10 tokens per channel keeps the fit's
    sampling error near a third of the signal; fewer, and the cross-validated ridge (or a
    fixed one) has to trade most of the fit away.
    """
    want = TOKENS_PER_CHANNEL * channels
    if tokens >= want:
        return None
    return (f"refit fits {channels} output-projection channels per layer from {tokens:,} calibration tokens; "
            f"{want:,} or more ({TOKENS_PER_CHANNEL} per channel) are recommended: raise calibration.num_samples "
            "or calibration.length (with fewer, ridge auto shrinks the refit towards mean compensation)")


def check_tokens(tokens: int, channels: int, layer: int) -> None:
    """Refit needs at least as many calibration tokens as channels, or S is rank-deficient by construction."""
    if tokens < channels:
        raise RefitError(f"refit compensation of layer {layer} fits {channels} output-projection channels from only "
                         f"{tokens} calibration tokens; use at least {channels} tokens (calibration.num_samples x "
                         "calibration.length; ten times as many is better) or surgery.compensation: mean")


@dataclass(frozen=True)
class Fit:
    """One layer's refit. delta_w touches only the kept columns (surgery zeroes / removes the pruned ones)."""

    delta_w: Tensor            # (d_model, D) float64
    delta_b: Tensor | None     # (d_model,) float64; None without an intercept
    unexplained: float         # E(P): the energy the kept heads cannot rebuild
    pruned: float              # tr(W_P S_PP W_P^T): what the pruned heads wrote (E(P) with A = 0)
    lam: float


def fit_layer(w: Tensor, mu: Tensor, s: Tensor, pruned: Tensor, ridge: float, layer: int = 0) -> Fit:
    """Refit one layer. w: (d_model, D); mu: (D,) or None (no intercept); s: (D, D); pruned: (D,) bool channels.

    The intercept is fitted exactly when `mu` is given (then `s` must be the covariance).
    Errors (RefitError, one line) for non-finite moments, a layer left without channels,
    or a singular / ill-conditioned system (ridge 0, or too small for this data).
    """
    f64 = torch.float64  # w may be in the model's dtype: only its pruned columns are read, in float64
    if not (torch.isfinite(s).all() and (mu is None or torch.isfinite(mu).all())):
        raise RefitError(f"refit compensation of layer {layer}: the calibration moments are NaN/inf (the model "
                         "produced non-finite activations; load it in float32)")
    P, K = pruned.nonzero().flatten(), (~pruned).nonzero().flatten()
    if len(K) == 0:
        raise RefitError(f"refit compensation of layer {layer}: every head is pruned, nothing is left to refit onto")
    lam = ridge_lambda(s, ridge)
    if len(P) == 0:
        return Fit(torch.zeros(w.shape, dtype=f64), None if mu is None else torch.zeros(w.shape[0], dtype=f64),
                   0.0, 0.0, lam)
    w_p = w[:, P].to(f64)  # (d_model, |P|)
    s_pp, s_kp = s[P[:, None], P], s[K[:, None], P]  # the blocks alone, no (|P|, D) rows beside them
    pruned_energy = float(((w_p @ s_pp) * w_p).sum())
    if silent(mu, s) or math.isinf(ridge):  # nothing to regress, or no regression (mean compensation)
        a = torch.zeros(len(K), len(P), dtype=f64)
    else:
        t_kk = s[K[:, None], K]
        t_kk.diagonal().add_(lam)  # S_KK + lam I without an identity matrix beside it
        a = _solve(t_kk, s_kp, layer, ridge)
        del t_kk
    s_pp.sub_(s_kp.t() @ a)  # the unexplained second moment, in place
    del s_kp
    unexplained = float(((w_p @ s_pp) * w_p).sum())
    del s_pp
    delta_b = None if mu is None else w_p @ (mu[P] - a.t() @ mu[K])
    return Fit(_new_columns(w.shape, K, w_p, a), delta_b, max(unexplained, 0.0), pruned_energy, lam)


def _new_columns(shape: tuple[int, int], K: Tensor, w_p: Tensor, a: Tensor) -> Tensor:
    """delta_W (d_model, D) float64: W_P A^T in the kept channels K, zero elsewhere; written a run of consecutive kept
    channels at a time into column slices (no (d_model, |K|) product or indexing copy beside it: 64 MiB each at 8B)."""
    delta_w = torch.zeros(shape, dtype=torch.float64)
    k = K.tolist()
    ends = [i + 1 for i in range(len(k)) if i + 1 == len(k) or k[i + 1] != k[i] + 1]  # a run ends after each
    start = 0
    for end in ends:
        delta_w[:, k[start]:k[end - 1] + 1] = w_p @ a[start:end].t()  # (d_model, run)
        start = end
    return delta_w


def _solve(t_kk: Tensor, s_kp: Tensor, layer: int, ridge: float) -> Tensor:
    """(S_KK + lam I)^-1 S_KP through a Cholesky factor, refusing singular or ill-conditioned systems."""
    eig = torch.linalg.eigvalsh(t_kk)
    if not eig[0] > 0:
        raise RefitError(f"refit compensation of layer {layer}: the kept heads' second moment is singular "
                         f"(ridge {ridge:g}); set surgery.ridge > 0 (e.g. 1e-3)")
    cond = float(eig[-1] / eig[0])
    if cond > MAX_CONDITION:
        raise RefitError(f"refit compensation of layer {layer}: the system is ill-conditioned (condition number "
                         f"{cond:.1e} with ridge {ridge:g}); raise surgery.ridge (e.g. 1e-3)")
    chol = torch.linalg.cholesky(t_kk)
    return torch.cholesky_solve(s_kp, chol)


@dataclass(frozen=True)
class System:
    """One layer's refit system for scoring many pruned sets: E(P) from one inverse.

    With T = S + lam I, the Schur complement of T_KK in T is ((T^-1)_PP)^-1, and it
    equals S's ridge Schur complement + lam I, so
    E(P) = tr(G_PP (((T^-1)_PP)^-1 - lam I)), G = W^T W: one |P| x |P| inverse per set.
    A silent layer (it writes nothing, or only a constant that the intercept takes) costs nothing.
    """

    gram: Tensor               # (D, D) W^T W as given (float32 from calibration: no float64 copy of every
    #                            layer's; the blocks each use reads are cast to float64, exactly)
    precision: Tensor | None   # (D, D) (S + lam I)^-1, float64; None for a silent layer
    lam: float
    error: str | None = None   # why no precision could be computed (raised when the system is used)

    def unexplained(self, pruned: Tensor) -> float:
        """E(P) for a (D,) boolean channel set."""
        if self.error:
            raise RefitError(self.error)
        P = pruned.nonzero().flatten()
        if len(P) == 0 or self.precision is None:
            return 0.0
        schur = torch.linalg.inv(self.precision[P[:, None], P]) - self.lam * torch.eye(len(P), dtype=torch.float64)
        return max(float((self.gram[P[:, None], P].double() * schur).sum()), 0.0)


BORDER_CHUNK = 4  # candidates bordered per product: (|P|, 4 d) matrices, as fast as all at once, without four
#                   (|P|, n d) ones beside Q (a square at |P| = D / 2, resized every greedy step)


def marginal_costs(sys: System, pruned: Tensor, blocks: list[Tensor], state: dict | None = None) -> list[float]:
    """E(P + h) - E(P) for every candidate block h of channels (each a (d,) index tensor), from one inverse.

    With Q = (S + lam I)^-1, A = Q_PP and its inverse, adding h makes the bordered matrix
    [[A, B], [B^T, C]] (B = Q_Ph, C = Q_hh), whose inverse is A^-1 corrected by the d x d Schur complement
    Z = C - V^T B, V = A^-1 B. With G = W^T W:
    E(P + h) - E(P) = tr((V^T G_PP V - 2 V^T G_Ph + G_hh) Z^-1) - lam tr(G_hh):
    |P|^2 d per candidate, where a fresh inverse of each enlarged set costs (|P| + d)^3.

    `state` (one per layer, kept by the caller across a greedy selection) holds A^-1 and its channel order: when
    P has grown since, A^-1 is bordered by the new channels' Schur complement (k^2 |P| for k), not inverted afresh.
    """
    if sys.error:
        raise RefitError(sys.error)
    if sys.precision is None:
        return [0.0] * len(blocks)
    Q, G = sys.precision, sys.gram
    P, a_inv = _pruned_inverse(Q, pruned, state)
    if not blocks:
        return []
    d = len(blocks[0])
    G_pp = G[P[:, None], P].double() if len(P) else None  # (|P|, |P|)
    out = []
    for first in range(0, len(blocks), BORDER_CHUNK):  # a few candidates' borders per product (see BORDER_CHUNK)
        chunk = blocks[first:first + BORDER_CHUNK]
        if len(P):  # each block indexed at once (no (|P|, D) rows)
            cand = torch.cat(chunk)  # (c d,) the chunk's channels, block after block
            B = Q[P[:, None], cand]  # (|P|, c d)
            V = a_inv @ B  # (|P|, c d)
            GV = G_pp @ V  # (|P|, c d)
            G_pc = G[P[:, None], cand].double()  # (|P|, c d)
        for i, h in enumerate(chunk):
            g_hh, Z = G[h[:, None], h].double(), Q[h[:, None], h]  # (d, d) the candidate's own blocks
            if len(P):
                j = slice(i * d, (i + 1) * d)
                Vh = V[:, j]
                core = Vh.t() @ GV[:, j] - 2 * Vh.t() @ G_pc[:, j] + g_hh
                Z = Z - B[:, j].t() @ Vh
            else:
                core = g_hh
            out.append(max(float((core * torch.linalg.inv(Z)).sum()) - sys.lam * float(torch.diagonal(g_hh).sum()), 0.0))
    return out


def _pruned_inverse(Q: Tensor, pruned: Tensor, state: dict | None) -> tuple[Tensor, Tensor | None]:
    """(P in the order A^-1 uses, A^-1 = ((Q)_PP)^-1 or None when P is empty), bordered from `state`'s when P
    only grew since (then `state` is updated), else inverted afresh."""
    P = pruned.nonzero().flatten()
    if not len(P):
        return P, None
    state = {} if state is None else state
    old, inv = state.get("order"), state.get("inverse")
    if old is None or not len(old) or not bool(pruned[old].all()):  # P is not a superset of the carried set
        inv = torch.linalg.inv(Q[P[:, None], P])
    elif len(old) < len(P):
        seen = torch.zeros_like(pruned)
        seen[old] = True
        new = P[~seen[P]]  # (k,) the channels pruned since
        b = Q[old[:, None], new]  # (|old|, k)
        v = inv @ b
        zi = torch.linalg.inv(Q[new[:, None], new] - b.t() @ v)  # (k, k) the new channels' Schur complement, inverted
        vz = v @ zi
        inv = torch.cat([torch.cat([inv + vz @ v.t(), -vz], 1), torch.cat([-vz.t(), zi], 1)], 0)
        P = torch.cat([old, new])
    else:  # the same set, in the carried order
        P = old
    state.update(order=P, inverse=inv)
    return P, inv


def system(w_gram: Tensor, mu: Tensor | None, s: Tensor, ridge: float, layer: int = 0) -> System:
    """The layer's `System` from W^T W (D, D), and mu / S as `fit_layer` takes them."""
    if silent(mu, s):
        return System(w_gram, None, 0.0)
    lam = ridge_lambda(s, ridge)
    t = s.double().clone()
    t.diagonal().add_(lam)  # S + lam I without an identity matrix beside it
    chol, info = torch.linalg.cholesky_ex(t)
    del t
    if info:  # only a scorer that reads it fails: the other scorers do not need it
        return System(w_gram, None, lam, f"refit-aware scoring of layer {layer}: the heads' second moment "
                      f"is singular (ridge {ridge:g}); set surgery.ridge > 0 (e.g. 1e-3)")
    return System(w_gram, torch.cholesky_inverse(chol), lam)


def silent(mu: Tensor | None, s: Tensor) -> bool:
    """The layer writes nothing a regression can use: S's diagonal is 0 (up to float64 rounding of
    M - mu mu^T, judged against the raw second moment)."""
    var = float(torch.diagonal(s).mean())
    scale = var + (0.0 if mu is None else float((mu.double() ** 2).mean()))
    return var <= 1e-12 * scale


# --- choosing the ridge by cross-validation (docs/design.md §8.2) ------------------------------------

RIDGE_GRID = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, math.inf)  # relative to the mean diagonal


@dataclass(frozen=True)
class RidgeChoice:
    """The ridge chosen for one layer's pruned set, and the held-out energy of every ridge tried.

    `heldout[i]` is the token-weighted mean over folds of the held-out fold's unexplained energy
    with `grid[i]` (relative ridge; inf = no regression: mean compensation with an intercept, no
    change without); `spread[i]` its standard error over folds. The choice is the largest ridge
    whose held-out energy is within one standard error of the least (the one-standard-error rule:
    among fits the data cannot tell apart, the one that trusts the calibration text least).
    """

    ridge: float
    grid: tuple[float, ...]
    heldout: tuple[float, ...]
    spread: tuple[float, ...]

    @property
    def best(self) -> float:
        return min(self.heldout)


def _fold_system(joint: Tensor, o: Tensor, n: Tensor, f: int, intercept: bool) -> tuple[Tensor, Tensor]:
    """The training system (total minus fold f) and the held-out fold's second moment around the training mean."""
    n_t = float(n.sum() - n[f])
    s_t = joint.sum(0).sub_(joint[f]).div_(n_t)  # in place: a few (D, D) float64 matrices at most per fold
    mu = (o.sum(0) - o[f]) / n_t if intercept else torch.zeros_like(o[f])
    if intercept:
        s_t.addr_(mu, mu, alpha=-1)  # rank-one updates in place: no (D, D) outer product beside them
    x_f = o[f] / n[f]
    c = joint[f] / n[f]  # E_f[(x - mu)(x - mu)^T]
    c.addr_(x_f, mu, alpha=-1).addr_(mu, x_f, alpha=-1).addr_(mu, mu)
    return symmetrize_(s_t), symmetrize_(c)


def heldout_energies(w: Tensor, joint: Tensor, o: Tensor, n: Tensor, pruned: Tensor, intercept: bool,
                     grid: tuple[float, ...] = RIDGE_GRID, between_folds: Callable[[], object] | None = None) -> Tensor:
    """(folds, ridges) held-out unexplained energy tr(W_P E_f[e e^T] W_P^T) of the fit trained without fold f.

    w: (d_model, D); joint (K, D, D), o (K, D), n (K,): fold sums (`FoldMoments`); pruned: (D,) bool.
    One eigendecomposition of each training S_KK gives every ridge: with S_KK = U diag(e) U^T and
    R = U^T S_KP, A(lam) = U diag(1 / (e + lam)) R, and the held-out energy is
    tr(G C_PP) - 2 sum_i v_i / (e_i + lam) + d^T (Z * H^T) d, d_i = 1 / (e_i + lam), with G = W_P^T W_P,
    C the held-out moment, v = diag(U^T C_KP G R^T), Z = U^T C_KK U, H = R G R^T.
    """
    joint, o, n = joint.double(), o.double(), n.double()
    P, K = pruned.nonzero().flatten(), (~pruned).nonzero().flatten()
    w_p = w[:, P].double()  # (d_model, |P|): only the pruned columns are read
    G = w_p.t() @ w_p  # (|P|, |P|)
    del w_p
    out = torch.zeros(len(n), len(grid), dtype=torch.float64)
    for f in range(len(n)):
        if n[f] == 0:
            continue
        s_t, c = _fold_system(joint, o, n, f, intercept)
        lam0 = float(torch.diagonal(s_t).mean().clamp_min(0))
        e, U = torch.linalg.eigh(s_t[K[:, None], K])  # the blocks alone, no (|K|, D) rows beside them
        R = U.t() @ s_t[K[:, None], P]
        del s_t
        v = ((U.t() @ c[K[:, None], P] @ G) * R).sum(-1)  # (|K|,)
        ZH = (U.t() @ c[K[:, None], K] @ U) * (R @ G @ R.t()).t()  # (|K|, |K|)
        base = float((G * c[P[:, None], P]).sum())
        del c
        for i, rel in enumerate(grid):
            lam = rel * lam0
            if math.isinf(lam):
                out[f, i] = base
                continue
            d = 1 / (e + lam)
            if not bool((e + lam > 0).all()) or not torch.isfinite(d).all():
                out[f, i] = math.inf
                continue
            out[f, i] = base - 2 * float((v * d).sum()) + float(d @ ZH @ d)
        del U, R, ZH  # not alive beside the next fold's
        if between_folds is not None:  # the caller's plumbing: freed memory handed back, say
            between_folds()
    return out


def choose_ridge(w: Tensor, joint: Tensor, o: Tensor, n: Tensor, pruned: Tensor, intercept: bool,
                 grid: tuple[float, ...] = RIDGE_GRID,
                 between_folds: Callable[[], object] | None = None) -> RidgeChoice:
    """K-fold cross-validated ridge for refitting `pruned` channels from the rest (see `heldout_energies`)."""
    per_fold = heldout_energies(w, joint, o, n, pruned, intercept, grid, between_folds)  # (K, ridges)
    used = n > 0
    weights = (n[used] / n[used].sum()).double()[:, None]
    mean = (per_fold[used] * weights).sum(0)
    k = int(used.sum())
    spread = per_fold[used].std(0, unbiased=True) / math.sqrt(k) if k > 1 else torch.zeros_like(mean)
    finite = torch.isfinite(mean)
    best = int(torch.where(finite, mean, torch.full_like(mean, math.inf)).argmin())
    bar = float(mean[best] + spread[best])
    pick = max(i for i in range(len(grid)) if finite[i] and float(mean[i]) <= bar)  # the grid ascends
    return RidgeChoice(grid[pick], tuple(grid), tuple(mean.tolist()), tuple(spread.tolist()))
