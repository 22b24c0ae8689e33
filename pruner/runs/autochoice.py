"""`scorer.name: auto` and `surgery.compensation: auto`: the pair chosen on held-back calibration samples.

No scorer or compensation is best on every model and kind of text (docs/results.md), and a choice
tuned on one kind of text does not always carry over to another. Practitioners choose on held-back
data of their own; this is that, built in. From one calibration pass over the samples that are
not held back (`calibration.holdout`, from every source of a mixture), every candidate scorer
gives its plan at the recipe's target, every candidate compensation is applied to it, and each
pair is scored by perplexity on the held-back samples -- one pass over them per pair, whole or a
block at a time as the run is -- and the pair with the lowest is kept (ties: the earlier candidate,
the default pair first). The held-back samples never entered the sums the plans and the
compensations were fitted on, so a compensation that overfits them (a ridge too small for the
text) and a scorer whose proxy misleads on this text are both seen for what they do.

What it costs is stated in the run: the calibration pass reads what every candidate needs (the
gradient pass for `gradient`, the refit systems for `refit-energy`, ...), then one held-back
pass per distinct pruned model (two scorers that chose the same heads are scored once). The
chosen pair then runs as if named, from the same calibration.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, replace

from pruner.core import arch, distributed, resume
from pruner.core.data import mask_tokens
from pruner.evaluation.perplexity import EvalWindows
from pruner.pruning.per_layer import CurveRequest
from pruner.pruning.scoring import ScoringInputs, get_scorer
from pruner.pruning.selection import check_target, curve_key, select
from pruner.runs import compensating, pipeline
from pruner.runs.context import Session
from pruner.runs.recipe import Recipe

DEFAULT_PAIR = ("refit-energy", "refit")


@dataclass(frozen=True)
class Choice:
    """The pair kept, every candidate's held-back perplexity, and what choosing cost."""

    scorer: str
    compensation: str
    table: list[dict]        # per pair: scorer, compensation, perplexity, delta (vs the unpruned model), seconds
    base: float              # the unpruned model's held-back perplexity
    samples: int             # held-back samples
    tokens: int              # scored tokens in them
    seconds: float           # the calibration pass and every held-back pass
    passes: int = 0          # held-back passes: one per distinct pruned model, and the unpruned one
    first: int = 0           # held-back samples every distinct pruned model was scored on (`rungs`)
    rest: int = 0            # distinct pruned models then scored on the other samples too

    def line(self) -> str:
        """Which pair and why, in one line."""
        best = self.table[0]
        runner = (f"; next {self.table[1]['scorer']} + {self.table[1]['compensation']} "
                  f"{self.table[1]['delta']:+.2f}") if len(self.table) > 1 else ""
        return (f"auto: {self.scorer} + {self.compensation}, the lowest held-back perplexity of {len(self.table)} "
                f"candidates ({best['perplexity']:.2f}, {best['delta']:+.2f} over the unpruned model on "
                f"{self.samples} held-back samples, {self.tokens} tokens{runner}); choosing took "
                f"{self.seconds:.1f} s: one calibration pass, {self.cost()}")

    def cost(self) -> str:
        """The held-back passes choosing made, in words."""
        models = self.passes - 1
        if self.first >= self.samples:
            return f"{models} pruned models and the unpruned one on every held-back sample"
        return (f"{models} pruned models on the first {self.first} held-back samples, the best {self.rest} on all "
                f"{self.samples}")

    def record(self) -> dict:
        """metrics.json's `auto` block."""
        return {"scorer": self.scorer, "compensation": self.compensation, "line": self.line(), "base": self.base,
                "samples": self.samples, "tokens": self.tokens, "seconds": round(self.seconds, 1),
                "passes": {"calibration": 1, "held_back": self.passes, "first_rung_samples": self.first,
                           "scored_on_all": self.rest}, "candidates": self.table}


def candidates(session: Session) -> list[tuple[str, str]]:
    """The (scorer, compensation) pairs auto chooses among, the default pair first; measured scorers dropped
    layer by layer (their ablations need the whole model). Fewer than two left: a one-line error, before any
    compute."""
    r = session.recipe
    scorers = r.scorer.choices()
    if session.onloader is not None:
        scorers = [s for s in scorers if not get_scorer(s).needs_ablation]
    pairs = [(s, c) for s in scorers for c in dict.fromkeys(r.surgery.choices())]
    pairs.sort(key=lambda p: p != DEFAULT_PAIR)
    if len(pairs) < 2:
        raise ValueError("auto has a single candidate left" + (f" ({pairs[0][0]} + {pairs[0][1]})" if pairs else "")
                         + " by the other settings (measured scorers are refused layer by layer): name it "
                           "instead, or give auto more candidates")
    return pairs


def heldout_windows(session: Session) -> EvalWindows:
    """The held-back samples as perplexity windows: next-token targets (decoders), or a seeded masking
    (encoders, as their evaluation masks lines)."""
    held = session.heldout
    if held is None or not len(held):
        raise ValueError("auto needs held-back samples: set calibration.holdout >= 1")
    if session.causal:
        return EvalWindows(held.input_ids, held.attention_mask, held.input_ids.masked_fill(held.attention_mask == 0,
                                                                                          -100))
    import torch

    g = torch.Generator().manual_seed(session.recipe.calibration.seed)
    ids, labels = mask_tokens(held.input_ids, held.attention_mask, session.tokenizer, 0.15, g)
    return EvalWindows(ids, held.attention_mask, labels)


def resolved(recipe: Recipe, scorer: str, compensation: str) -> Recipe:
    """The recipe as if the pair had been named (candidates cleared, the held-back count written out)."""
    return recipe.model_copy(update={
        "scorer": recipe.scorer.model_copy(update={"name": scorer, "candidates": None}),
        "surgery": recipe.surgery.model_copy(update={"compensation": compensation, "candidates": None}),
        "calibration": recipe.calibration.model_copy(update={"holdout": recipe.calibration.held_back(True)})})


def _perplexity(nll, count) -> float:
    return math.exp(float(nll.sum()) / max(int(count.sum()), 1))


def rungs(samples: int, models: int) -> tuple[int, int]:
    """(the held-back samples every candidate is scored on first, how many candidates are then scored on the
    rest): with more than 4 distinct pruned models and at least 8 samples, every one on the first quarter
    and the best quarter of them (at least 2) on the rest -- successive halving's two rungs, about half the
    passes of scoring every candidate on every sample; else every candidate on every sample."""
    if models <= 4 or samples < 8:
        return samples, models
    return -(-samples // 4), max(2, -(-models // 4))


def _rows(windows: EvalWindows, rows: range) -> EvalWindows:
    idx = slice(rows.start, rows.stop)
    return EvalWindows(windows.input_ids[idx], windows.attention_mask[idx], windows.labels[idx])


@dataclass
class _Scoring:
    """The held-back scoring of the distinct pruned models: running NLL sums and token counts, seconds."""

    session: Session          # the held-back samples as its evaluation windows
    windows: EvalWindows
    plans: dict
    compensation: object      # (scorer, kind) -> the compensation to apply
    sums: dict
    seconds: dict

    def score(self, key, pair: tuple[str, str], rows: range) -> None:
        t1 = time.time()
        part = replace(self.session, _evaluation=_rows(self.windows, rows))
        nll, count, _ = pipeline._window_scores(part, self.plans[pair[0]].heads, self.compensation(pair))
        total = self.sums.setdefault(key, [0.0, 0])
        total[0], total[1] = total[0] + float(nll.sum()), total[1] + int(count.sum())
        self.seconds[key] = self.seconds.get(key, 0.0) + time.time() - t1

    def perplexity(self, key) -> float:
        return math.exp(self.sums[key][0] / max(self.sums[key][1], 1))


def _table(held: Session, windows: EvalWindows, pairs: list, plans: dict, compensation):
    """Every pair's held-back perplexity in the two rungs of `rungs` (best first: those scored on every
    sample, then those dropped after the first rung), the unpruned model's, the tokens scored, the passes
    (distinct pruned models and the unpruned one), the first rung's samples and the models scored on all."""
    base_nll, base_count, _ = pipeline._window_scores(held)
    key_of = {(s, k): (k, tuple(sorted((layer, tuple(sorted(h))) for layer, h in plans[s].heads.items())))
              for s, k in pairs}  # two scorers with the same plan give the same pruned model: scored once
    models = {}
    for pair in pairs:
        models.setdefault(key_of[pair], pair)
    scoring, n = _Scoring(held, windows, plans, compensation, {}, {}), len(windows)
    first, keep = rungs(n, len(models))
    for key, pair in models.items():
        scoring.score(key, pair, range(first))
    survivors = sorted(models, key=scoring.perplexity)[:keep]  # stable: ties keep the candidates' order
    if DEFAULT_PAIR in key_of and key_of[DEFAULT_PAIR] not in survivors:  # never dropped on a quarter
        survivors.append(key_of[DEFAULT_PAIR])
    for key in survivors if first < n else ():
        scoring.score(key, models[key], range(first, n))
    table = []
    for pair in pairs:
        key = key_of[pair]
        rows = n if first == n or key in survivors else first
        ppl = scoring.perplexity(key)
        table.append({"scorer": pair[0], "compensation": pair[1], "perplexity": ppl,
                      "delta": ppl - _perplexity(base_nll[:rows], base_count[:rows]), "samples": rows,
                      "seconds": round(scoring.seconds[key], 2)})
    table.sort(key=lambda row: (-row["samples"], row["perplexity"]))  # stable: ties keep the candidates' order
    return (table, _perplexity(base_nll, base_count), int(base_count.sum()), len(models) + 1, first,
            len(models) if first == n else len(survivors))


def choose(session: Session, progress: bool = True, inputs: ScoringInputs | None = None):
    """(the session with the chosen recipe, the calibration's inputs, the `Choice`): see the module docstring.
    `inputs`: a calibration of every candidate already made (one for several targets), not made again."""
    t0 = time.time()
    pairs, r = candidates(session), session.recipe
    windows = heldout_windows(session)
    scorers, kinds = list(dict.fromkeys(s for s, _ in pairs)), list(dict.fromkeys(c for _, c in pairs))
    measure = pipeline.measured_compensation("auto", kinds)  # the measured scorers compensate as the refit would
    probe = replace(session, recipe=resolved(r, scorers[0], measure))
    geom = arch.geometry(session.model)
    cfg = pipeline.selection_config(probe.recipe, session.model)
    check_target(geom, cfg)
    if "refit" in kinds:
        pipeline.check_refit_tokens(probe)
    keys = tuple(dict.fromkeys(curve_key(get_scorer(s), geom, cfg) for s in scorers))
    if inputs is None:
        inputs = pipeline.scoring_inputs(probe, [get_scorer(s) for s in scorers], CurveRequest(keys), kinds,
                                         progress)
    pick = (lambda f: distributed.from_root(f)) if pipeline.root_keeps(session) else (lambda f: f())
    plans = {s: pick(lambda s=s: select(get_scorer(s), inputs, geom, cfg)) for s in scorers}
    held = replace(session, _evaluation=windows, _downstream=None, checkpoints=resume.NONE)
    base_nll, base_count, _ = pipeline._window_scores(held)
    refit_spec = probe.recipe.surgery.model_copy(update={"compensation": "refit"})
    refits = {}
    if "refit" in kinds and compensating.needs_pass(inputs, None, refit_spec):  # one pass for every plan's refit
        refits = dict(zip(scorers, compensating.oneshot_refits(session, [plans[s].heads for s in scorers],
                                                               refit_spec)))

    @functools.cache  # a survivor is scored in both rungs: its compensation is made once
    def compensation(pair):
        scorer, kind = pair
        spec = probe.recipe.surgery.model_copy(update={"compensation": kind})
        return refits[scorer] if kind == "refit" and scorer in refits else \
            compensating.shared_compensation(session, plans[scorer].heads, spec, inputs)

    table, base, tokens, passes, first, rest = _table(held, windows, pairs, plans, compensation)
    choice = Choice(table[0]["scorer"], table[0]["compensation"], table, base, len(windows), tokens,
                    time.time() - t0, passes, first, rest)
    return replace(session, recipe=resolved(r, choice.scorer, choice.compensation)), inputs, choice


def plan(session: Session, progress: bool = True):
    """`pruner.plan`: the recipe's plan; with auto, the chosen pair's (from the same calibration)."""
    if not session.recipe.auto():
        return pipeline.make_plan(session, progress=progress)
    chosen, inputs, _ = choose(session, progress)
    return pipeline.make_plan(chosen, inputs, progress=progress)


def prune(session: Session, progress: bool = True) -> pipeline.RunResult:
    """`pruner prune`: the recipe's run; with auto, the pair chosen on the held-back samples, run from the same
    calibration, its metrics saying which pair, why (`Choice.line`) and at what cost."""
    if not session.recipe.auto():
        return pipeline.run(session, progress)
    t0 = time.time()
    chosen, inputs, choice = choose(session, progress)
    done = pipeline.run(chosen, progress, inputs=inputs)
    done.metrics["auto"] = choice.record()
    done.metrics["seconds"] = round(time.time() - t0, 1)
    return done
