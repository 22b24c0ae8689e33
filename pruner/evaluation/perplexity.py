"""Perplexity, computed directly (no `evaluate.load`: it fetches scripts from the Hub).

Decoders: token-level perplexity with a strided sliding window, the Hugging Face
perplexity-guide convention: each window sees up to `length` tokens, only the
tokens not already scored by the previous window are labelled (the rest are
context, label -100), and NLL is token-weighted over all windows. With `bos`,
every window starts with BOS (never a target), so the model always has the
sink it was trained with.

Comparisons are paired: the unpruned and pruned model are scored on the same
windows, and the confidence interval of the perplexity change comes from a
bootstrap over windows.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from pruner.core import arch, distributed
from pruner.core.bootstrap import percentile_interval, resamples
from pruner.core.data import DataError, bos_token_id, line_samples, mask_tokens
from pruner.core.layerwise import Onloader, blockwise
from pruner.core.runtime import forward


@dataclass(frozen=True)
class EvalWindows:
    """input_ids, attention_mask, labels: (window, q_pos); labels -100 off-target."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def sliding_windows(tokenizer, texts: list[str], length: int, stride: int | None = None, *,
                    bos: bool = True, max_windows: int | None = None) -> EvalWindows:
    """Strided windows over the concatenated texts (documents joined with EOS)."""
    stride = stride or length - (1 if bos else 0)
    body = length - (1 if bos else 0)
    if not 0 < stride <= body:
        raise DataError(f"stride must be in [1, {body}], got {stride}")
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"] + ([sep] if sep is not None else [])
    if len(ids) < 2:
        raise DataError("evaluation text has fewer than 2 tokens")
    rows, labels = [], []
    prev_end = 0
    for begin in range(0, len(ids), stride):
        end = min(begin + body, len(ids))
        trg = end - prev_end
        window = ids[begin:end]
        lab = [-100] * (len(window) - trg) + window[len(window) - trg:]
        if bos:
            window, lab = [bos_token_id(tokenizer)] + window, [-100] + lab
        elif begin == 0:
            lab[0] = -100  # the very first token has no context
        rows.append(window)
        labels.append(lab)
        prev_end = end
        if end == len(ids) or (max_windows and len(rows) == max_windows):
            break
    width = max(len(r) for r in rows)

    def pad(r, v):
        return r + [v] * (width - len(r))

    ids_t = torch.tensor([pad(r, 0) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return EvalWindows(ids_t, mask, torch.tensor([pad(r, -100) for r in labels]))


def masked_lines(tokenizer, texts: list[str], max_length: int, *, num_samples: int | None = None,
                 seed: int = 0, mask_prob: float = 0.15) -> EvalWindows:
    """Encoder evaluation: lines with a fixed, seeded BERT masking; labels at the masked tokens."""
    lines = line_samples(tokenizer, texts, max_length, num_samples=num_samples, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids, labels = mask_tokens(lines.input_ids, lines.attention_mask, tokenizer, mask_prob, g)
    return EvalWindows(ids, lines.attention_mask, labels)


@torch.no_grad()
def window_nll(model, windows: EvalWindows, batch_size: int = 8, progress: bool = False,
               causal: bool = True):
    """Per-window summed NLL and target count: (window,) float64 and (window,) int."""
    nll, count, _ = window_scores(model, windows, batch_size, progress, causal)
    return nll, count


@dataclass(frozen=True)
class BlockwisePass:
    """`window_scores` one block at a time (`capture.onload: sequential`)."""

    onloader: Onloader | None                                      # where the blocks come from (None: in memory)
    device: str | torch.device = "cpu"                             # where each onloaded block computes
    within: Callable[[int], AbstractContextManager] | None = None  # a scope each block runs under (a scoped mask)


@torch.no_grad()
def window_scores(model, windows: EvalWindows, batch_size: int = 8, progress: bool = False,
                  causal: bool = True, pool: bool = False, blocks: BlockwisePass | None = None):
    """Per-window NLL sums, target counts and, with `pool`, pooled embeddings — one forward pass.

    Causal LMs predict token t+1 at position t; masked LMs predict each labelled
    position itself. Embeddings are the mean of the last hidden states over real
    tokens (sentence-transformers' pooling). Returns (window,) float64, (window,)
    int, and (window, d) or None.

    With `blocks.onloader` (`capture.onload: sequential`) the pass runs one block at a time
    (`pruner.core.layerwise`): every batch through block 0, then block 1, ..., each block
    run under `within(layer)` (a scoped mask: the pruned model without the whole of it in
    memory); the model's own code after the blocks then scores the last hidden states.
    The same numbers as the whole-model pass: the same blocks on the same inputs.
    """
    onloader, device, within = (None, "cpu", None) if blocks is None else \
        (blocks.onloader, blocks.device, blocks.within)
    model.eval()
    mine = torch.tensor(distributed.shard_indices(len(windows)), dtype=torch.long)  # several processes
    parts = [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    nll, count, emb = [], [], []
    if onloader is None:
        if within is not None:
            raise ValueError("within: a per-block scope is for the layer-by-layer pass (onloader)")
        for idx in (tqdm(parts, desc="perplexity", unit="batch") if progress else parts):
            _score(model, windows, idx, causal, pool, nll, count, emb)
    else:
        bar = tqdm(total=len(arch.blocks(model)), desc="perplexity (layer by layer)", unit="layer") \
            if progress else None
        batches = [(windows.input_ids[idx], windows.attention_mask[idx]) for idx in parts]
        with blockwise(model, onloader, batches, device, within, bar) as (calls, replay):
            for idx, call in zip(parts, calls):
                replay.hidden = call.hidden
                _score(model, windows, idx, causal, pool, nll, count, emb)

    def cat(xs):
        return torch.cat(xs) if xs else None  # (a process may hold no windows)

    n = len(windows)
    return (distributed.gather_rows(cat(nll), n), distributed.gather_rows(cat(count), n),
            distributed.gather_rows(cat(emb), n) if pool else None)


LOGIT_BYTES = 64 << 20  # a causal LM's logits are computed for this many bytes of float32 at a time


def _score(model, windows: EvalWindows, idx: torch.Tensor, causal: bool, pool: bool, nll: list, count: list,
           emb: list) -> None:
    """One batch's per-window NLL sums, target counts and pooled embeddings, appended to the lists."""
    ids, mask = windows.input_ids[idx], windows.attention_mask[idx]
    lab = windows.labels[idx]
    head = _plain_head(model) if causal and not pool else None
    if head is not None:  # next-token NLL a slice of positions at a time
        hidden = forward(model.base_model, ids, mask).last_hidden_state  # (B, T, d): after the final norm
        tok = next_token_nll(head, hidden, lab.to(hidden.device))
        target = lab[:, 1:].to(tok.device)
    else:
        out = forward(model, ids, mask, output_hidden_states=pool)
        if pool:
            h = out.hidden_states[-1].float()
            m = mask[..., None].to(h)
            emb.append(((h * m).sum(1) / m.sum(1)).cpu())
        logits = out.logits.float()
        lab = lab.to(logits.device)
        if causal:
            logits, target = logits[:, :-1], lab[:, 1:]  # position t predicts token t+1
        else:
            target = lab
        tok = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target.clamp_min(0),
                                                reduction="none")  # (B, T')
    on = target != -100
    nll.append((tok * on).sum(-1).double().cpu())
    count.append(on.sum(-1).cpu())


def next_token_nll(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's NLL of the next token, (B, T - 1) float32, from the last hidden states (B, T, d) and the
    language-model head, a slice of positions at a time.

    What the model's own forward computes -- the head on every position, then the loss -- without its (B, T,
    vocab) logits and their float32 copy at once: for a 128k vocabulary, batch 4 x 256 tokens, 1.3 GB that the
    slices bring to `LOGIT_BYTES`. Each position's logits are the same product either way; labels -100 (and
    padding) give 0 where they are not counted.
    """
    B, T, _ = hidden.shape
    vocab = head.weight.shape[0]
    step = max(1, LOGIT_BYTES // max(1, B * vocab * 4))
    out = []
    for a in range(0, T - 1, step):
        b = min(T - 1, a + step)
        logits = head(hidden[:, a:b]).float()  # (B, b - a, vocab)
        out.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, a + 1:b + 1].clamp_min(0),
                                                     reduction="none"))
    return torch.cat(out, 1) if out else hidden.new_zeros(B, 0)


@dataclass(frozen=True)
class PairScores:
    """A teacher and a model scored together on the same windows (`pair_scores`)."""

    teacher_nll: torch.Tensor  # (window,) float64: summed next-token NLL, as `window_scores`
    model_nll: torch.Tensor    # (window,) float64
    count: torch.Tensor        # (window,) int: the positions both count
    kl: float                  # mean KL(teacher || model) per counted position


@torch.no_grad()
def pair_scores(teacher, model, windows: EvalWindows) -> PairScores:
    """Both models' per-window next-token NLL and the mean KL(teacher || model) per counted position, from one
    pass of each over `windows` (causal LMs with one tokenizer): what `window_scores` of each and a separate
    divergence pass would give, with each model run once instead of twice.

    As many windows at a time as keep one model's float32 logits of a batch within 4 x `LOGIT_BYTES` (at least
    one), and, where both models have a plain head, a slice of positions at a time within `LOGIT_BYTES`: with a
    128k vocabulary a 2,048-token window's logits would be 1 GB apiece. Several processes split the windows.
    """
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else model.config.vocab_size
    batch = max(1, 4 * LOGIT_BYTES // (4 * vocab * windows.input_ids.shape[1]))
    mine = torch.tensor(distributed.shard_indices(len(windows)), dtype=torch.long)
    rows: dict[str, list] = {"teacher": [], "model": [], "count": [], "kl": []}
    for idx in mine.split(batch):
        ids, mask, lab = windows.input_ids[idx], windows.attention_mask[idx], windows.labels[idx]
        target = lab[:, 1:]                                                          # (B, T-1)
        (ht, head_t), (hs, head_s) = _last(teacher, ids, mask), _last(model, ids, mask)
        sums = torch.zeros(3, len(idx), dtype=torch.float64)                         # teacher, model, KL
        step = max(1, LOGIT_BYTES // (4 * len(ids) * vocab))
        for a in range(0, ids.shape[1] - 1, step):
            b = min(ids.shape[1] - 1, a + step)
            lt = torch.log_softmax(head_t(ht[:, a:b]).float(), -1)                  # (B, b-a, V)
            ls = torch.log_softmax(head_s(hs[:, a:b]).float(), -1).to(lt.device)
            on = (target[:, a:b] != -100).to(lt.device)                              # (B, b-a)
            y = target[:, a:b].clamp_min(0).to(lt.device)[..., None]
            per = torch.stack([-lt.gather(-1, y)[..., 0], -ls.gather(-1, y)[..., 0], (lt.exp() * (lt - ls)).sum(-1)])
            sums += (per * on).sum(-1).double().cpu()
        for key, x in zip(("teacher", "model", "kl"), sums):
            rows[key].append(x)
        rows["count"].append((target != -100).sum(-1))
    cat = {k: torch.cat(v) if v else None for k, v in rows.items()}  # (a process may hold no windows)
    got = {k: distributed.gather_rows(v, len(windows)) for k, v in cat.items()}
    kl = float(got["kl"].sum()) / max(int(got["count"].sum()), 1)
    return PairScores(got["teacher"], got["model"], got["count"], kl)


def _last(model, ids, mask) -> tuple[torch.Tensor, Callable]:
    """(last hidden states, the plain head) where the model has one, else (its logits, identity); `forward` moves the
    inputs to the model."""
    head = _plain_head(model)
    if head is None:
        return forward(model, ids, mask).logits, lambda x: x
    return forward(model.base_model, ids, mask).last_hidden_state, head


def _plain_head(model) -> torch.nn.Module | None:
    """The LM head where the model's logits are that head applied to `base_model`'s last hidden states and nothing
    more -- `lm_head` (Llama, Mistral, Qwen, GPT-2) or `embed_out` (GPT-NeoX) -- else None: a head with a transform
    of its own before the output embedding (BERT's prediction head: dense, activation, LayerNorm, as in the causal
    MiniLM) or logits the forward post-processes are computed by the model's own forward."""
    head = model.get_output_embeddings()
    if head is None or _post_processes_logits(model):
        return None
    return head if any(getattr(model, name, None) is head for name in ("lm_head", "embed_out")) else None


def _post_processes_logits(model) -> bool:
    """Whether the model's forward does more to its head's output than return it (soft-capping, a scale)."""
    cfg = model.config
    return any(getattr(cfg, k, None) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale",
                                                                      "logits_scaling", "output_multiplier_scale"))


def perplexity(nll: torch.Tensor, count: torch.Tensor) -> float:
    return math.exp(nll.sum().item() / count.sum().item())


@dataclass(frozen=True)
class PairedDelta:
    """Perplexity of base and pruned on the same windows, the change and its bootstrap CI."""

    base: float
    pruned: float
    delta: float
    ci_low: float
    ci_high: float
    windows: int
    tokens: int


def paired_delta(base: tuple[torch.Tensor, torch.Tensor], pruned: tuple[torch.Tensor, torch.Tensor],
                 n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> PairedDelta:
    """Change in perplexity with a percentile bootstrap over windows (paired resampling)."""
    (nb, c), (np_, c2) = base, pruned
    if not torch.equal(c, c2):
        raise ValueError("paired comparison needs the same windows")
    g = torch.Generator().manual_seed(seed)
    idx = resamples(len(c), n_boot, g)
    cs = c[idx].sum(-1).double()
    boot = torch.exp(np_[idx].sum(-1) / cs) - torch.exp(nb[idx].sum(-1) / cs)
    lo, hi = percentile_interval(boot, level)
    pb, pp = perplexity(nb, c), perplexity(np_, c)
    return PairedDelta(pb, pp, pp - pb, lo, hi, len(c), int(c.sum()))


def fidelity(base: torch.Tensor, pruned: torch.Tensor) -> float:
    """Mean cosine between unpruned and pruned pooled embeddings of the same samples (1 = unchanged)."""
    return torch.nn.functional.cosine_similarity(base, pruned, dim=-1).mean().item()


@torch.no_grad()
def latency_ms(model, windows: EvalWindows, batch_size: int = 8, repeats: int = 3) -> float:
    """Median wall time (ms) of one forward pass over one evaluation batch."""
    import time

    ids, mask = windows.input_ids[:batch_size], windows.attention_mask[:batch_size]
    forward(model, ids, mask)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        forward(model, ids, mask)
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]
