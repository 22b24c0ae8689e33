"""The driver: calibrate -> score -> select -> prune -> evaluate -> save. No logic of its own.

`run(recipe, out)` is `pruner prune`; `compare(...)` is `pruner compare`: one
calibration pass shared by every scorer, every scorer x sparsity x compensation
evaluated with a scoped mask on the same evaluation windows.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pruner import arch, data, distributed, export, models, surgery
from pruner.calibrate import calibrate
from pruner.capture import CaptureConfig, resolve_auto_sinks
from pruner.evaluate import (EvalWindows, fidelity, latency_ms, masked_lines, paired_delta, sliding_windows,
                             window_scores)
from pruner.recipe import Recipe
from pruner.scoring import ScoringInputs, get_scorer
from pruner.selection import Plan, SelectionConfig, SelectionError, check_target, convention_sensitivity, select
from pruner.sinks import SinkSpec, check_content, default_spec


@dataclass
class Session:
    """What every stage shares: the loaded model and data, built once."""

    recipe: Recipe
    model: object
    tokenizer: object
    causal: bool
    sinks: SinkSpec
    calibration: data.TokenBatch
    evaluation: EvalWindows


def _source(spec) -> data.TextSource:
    return data.TextSource(spec.data, split=spec.split, text_column=spec.text_column, name=spec.name)


def prepare(recipe: Recipe, progress: bool = True) -> Session:
    """Load the model, tokenizer, calibration samples and evaluation windows."""
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    m = recipe.model
    model = models.load_base(m, device=distributed.local_device(m.device))
    arch.adapter_for(model)  # unsupported architecture: fail before any compute
    tok = models.load_tokenizer(m.path)
    causal = models.attends_causally(model)
    cal, ev = recipe.calibration, recipe.evaluation
    batch = data.samples(tok, data.load_texts(_source(cal)), cal.unit, cal.length, bos=cal.bos,
                         num_samples=cal.num_samples, seed=cal.seed)
    ev_texts = data.load_texts(_source(ev))
    if causal:
        windows = sliding_windows(tok, ev_texts, ev.length, ev.stride, bos=ev.bos, max_windows=ev.num_samples)
    else:
        if not hasattr(model, "cls"):
            raise ValueError(f"{m.path}: masked-token perplexity needs a masked-LM head "
                             "(set model.mlm_readout: shipped for all-MiniLM-L6-v2)")
        windows = masked_lines(tok, ev_texts, ev.length, num_samples=ev.num_samples, seed=ev.seed)
    s = recipe.sinks
    spec = default_spec(causal) if s.mode is None else SinkSpec(s.mode, tuple(s.ids), tuple(s.positions), s.eps)
    if spec.mode == "auto":
        spec = resolve_auto_sinks(model, batch, tok, eps=spec.eps, batch_size=cal.batch_size)
    check_content(batch.input_ids, batch.attention_mask, spec, tok)
    return Session(recipe, model, tok, causal, spec, batch, windows)


def scoring_inputs(session: Session, gradient: bool, progress: bool = True) -> ScoringInputs:
    r = session.recipe
    metrics = tuple(dict.fromkeys(["cosine", *r.capture.metrics]))  # redundancy scorers read cosine
    cfg = CaptureConfig(chunk_size=r.capture.chunk_size, metrics=metrics, outputs=True)
    return calibrate(session.model, session.calibration, session.sinks, session.tokenizer,
                     gradient=gradient, config=cfg, batch_size=r.calibration.batch_size,
                     seed=r.selection.seed, progress=progress)


def _selection_config(recipe: Recipe, target: float | None = None) -> SelectionConfig:
    s = recipe.selection
    return SelectionConfig(target=s.target if target is None else target, budget=s.budget,
                           min_heads_per_layer=s.min_heads_per_layer, gqa=s.gqa)


def evaluate_plan(session: Session, plan_heads: dict[int, list[int]], bias, base) -> dict:
    """Perplexity (and fidelity for encoders) of the scoped-masked model vs the base on the same windows."""
    ev = session.recipe.evaluation
    with surgery.masked(session.model, plan_heads, bias):
        nll, count, emb = window_scores(session.model, session.evaluation, ev.batch_size,
                                        causal=session.causal, pool=not session.causal)
    d = paired_delta(base["nll"], (nll, count), n_boot=max(ev.bootstrap, 1), seed=ev.seed)
    out = asdict(d)
    if emb is not None:
        out["fidelity"] = fidelity(base["emb"], emb)
    return out


def base_metrics(session: Session, progress: bool = True) -> dict:
    ev = session.recipe.evaluation
    nll, count, emb = window_scores(session.model, session.evaluation, ev.batch_size, progress=progress,
                                    causal=session.causal, pool=not session.causal)
    return {"nll": (nll, count), "emb": emb}


def compare(recipe: Recipe, scorers: list[str], sparsities: list[float], compensations: list[str],
            progress: bool = True) -> list[dict]:
    """Every scorer x sparsity x compensation on the same windows; one calibration pass."""
    from tqdm.auto import tqdm

    for name in scorers:
        get_scorer(name)
    session = prepare(recipe, progress)
    inputs = scoring_inputs(session, gradient="gradient" in scorers, progress=progress)
    base = base_metrics(session, progress)
    geom = arch.geometry(session.model)
    records = []
    jobs = [(s, p) for s in scorers for p in sparsities]
    for name, target in (tqdm(jobs, desc="compare", unit="plan") if progress else jobs):
        scorer = get_scorer(name)
        try:
            plan = select(scorer, inputs, geom, _selection_config(recipe, target))
        except SelectionError as e:  # e.g. a per-layer budget too small for a GQA unit
            records += [{"scorer": name, "sparsity": target, "compensation": c, "error": str(e)}
                        for c in compensations]
            continue
        for comp in compensations:
            bias = surgery.compensation_bias(session.model, plan.heads, inputs.stats.outputs) \
                if comp == "mean" else None
            m = evaluate_plan(session, plan.heads, bias, base)
            records.append({"scorer": name, "sparsity": target, "compensation": comp,
                            "pruned_heads": len(plan.entries), "heads": {str(k): v for k, v in plan.heads.items()},
                            **m})
    return records


@dataclass
class RunResult:
    plan: Plan
    metrics: dict
    out: Path
    model: object
    tokenizer: object
    bias: dict[int, torch.Tensor] | None  # folded mean compensation, {layer: (d_model,)}; None for `zero`


def run(recipe: Recipe, out: Path, progress: bool = True) -> RunResult:
    """`pruner prune`: calibrate, score, select, prune, evaluate, save."""
    t0 = time.time()
    session = prepare(recipe, progress)
    scorer = get_scorer(recipe.scorer.name)
    geom = arch.geometry(session.model)
    cfg = _selection_config(recipe)
    check_target(geom, cfg)  # an impossible target fails before any calibration compute
    inputs = scoring_inputs(session, gradient=scorer.needs_gradient, progress=progress)
    plan = select(scorer, inputs, geom, cfg, convention=recipe.scorer.convention)
    sens_of = scorer.name if plan.convention else "cosine"
    sens = convention_sensitivity(scorer, inputs, geom, cfg, plan)
    if sens is None:  # not an attention-redundancy scorer: show how fragile the naive one is here
        naive = get_scorer(sens_of)
        sens = convention_sensitivity(naive, inputs, geom, cfg, select(naive, inputs, geom, cfg))
    base = base_metrics(session, progress)
    model = session.model
    params_before = sum(p.numel() for p in model.parameters())
    latency_before = latency_ms(model, session.evaluation) if recipe.evaluation.latency else None
    bias = surgery.compensation_bias(model, plan.heads, inputs.stats.outputs) \
        if recipe.surgery.compensation == "mean" else None
    m = evaluate_plan(session, plan.heads, bias, base)  # scoped mask: same numbers as the surgery below
    if recipe.surgery.mode == "remove":
        surgery.remove_heads(model, plan.heads, bias)
    else:
        surgery.mask_heads(model, plan.heads, bias)
    metrics = {
        "model": recipe.model.path, "scorer": scorer.name, "convention": plan.convention,
        "sparsity": recipe.selection.target, "pruned_heads": len(plan.entries),
        "total_heads": geom.n_layers * geom.n_heads, "compensation": recipe.surgery.compensation,
        "surgery": recipe.surgery.mode, "sinks": asdict(session.sinks),
        "evaluation": m, "params_before": params_before,
        "params_after": sum(p.numel() for p in model.parameters()),
        "latency_ms_before": latency_before,
        "latency_ms_after": latency_ms(model, session.evaluation) if recipe.evaluation.latency else None,
        "convention_sensitivity": {**asdict(sens), "scorer": sens_of},
        "seconds": round(time.time() - t0, 1),
    }
    return RunResult(plan, metrics, out, model, session.tokenizer, bias)


def save_model(result: RunResult, folder: Path) -> None:
    """Save the pruned model where vanilla `from_pretrained` can load it (reload-checked), or say why not."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        export.save_checkpoint(result.model, result.tokenizer, folder, removed=result.metrics["surgery"] == "remove")
    except export.ExportError as e:
        for f in folder.iterdir():  # nothing half-written next to the note
            shutil.rmtree(f) if f.is_dir() else f.unlink()
        (folder / "NOT_SAVED.txt").write_text(
            f"This pruned model was not saved as a vanilla transformers checkpoint. {e}\n")
        result.metrics["model_saved"] = False
        result.metrics["model_not_saved_because"] = str(e)
        return
    result.metrics["model_saved"] = True


def to_jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
