"""`evaluate`, `load` and `export_run`: measuring, loading and sharing what pruner made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pruner.api.arguments import IN_MEMORY, model_name, resolve_call
from pruner.checkpoints import loading
from pruner.core import runtime
from pruner.evaluation import accuracy
from pruner.evaluation.downstream import Downstream
from pruner.runs import context, export, folders, provenance


@dataclass
class Evaluation:
    """Perplexity of one model on the evaluation windows, and with evaluation.tasks each task's accuracy;
    paired with a base model when one is given (a run folder's base, or `base=`)."""

    metrics: dict

    def __repr__(self) -> str:
        m = self.metrics
        text = f"Evaluation({m['model']}: perplexity {m['perplexity']:.2f} on {m['windows']} windows"
        if "delta" in m:
            text += f"; vs {m['base_model']} {m['base']:.2f}: {m['delta']:+.2f} [{m['ci_low']:+.2f}, {m['ci_high']:+.2f}]"
        for task, metrics in m.get("tasks", {}).items():
            d = metrics.get("acc") or next(iter(metrics.values()))
            text += (f"; {task} acc {d['pruned']:.3f} ({d['delta']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}])"
                     if "delta" in d else f"; {task} acc {d['value']:.3f} [{d['ci_low']:.3f}, {d['ci_high']:.3f}]")
        return text + ")"

    def table(self) -> str:
        """Markdown: each task's accuracy (with a base: base, this model, the paired change) and 95% CI."""
        return accuracy.accuracy_table(self.metrics.get("tasks", {}))


def evaluate(model, tokenizer=None, data=None, *, base=None, recipe=None, progress: bool = True,
             allow_changed_base: bool = False, **overrides) -> Evaluation:
    """Perplexity (and downstream accuracy) of a model object, a shipped name / folder / Hub id, an export,
    or a run folder.

    A run folder (what `pruner prune` wrote) is rebuilt from its base model and
    plan and evaluated paired with that base, as `prune` measured it. `base` (a
    model object or name) pairs any other model with a base on the same windows
    and documents. `data`: evaluation texts or source (default: the recipe's, the
    shipped evaluation plays). `tasks=[...]` (and `task_paths`, `task_limit`,
    `num_fewshot`) adds lm-evaluation-harness / embedding tasks: accuracy with a
    bootstrap CI, or with a base the paired change. A run folder whose base model
    is no longer the one it was made from (provenance.json) is refused unless
    `allow_changed_base`.
    """
    from pruner.evaluation import tasks
    from pruner.evaluation.perplexity import perplexity, window_scores

    if isinstance(model, (str, Path)) and (Path(model) / "plan.json").exists():
        model, tokenizer, name, base, recipe = _rebuilt_run(model, base, recipe, allow_changed_base)
    else:
        name = str(model) if isinstance(model, (str, Path)) else model_name(model)
    call = resolve_call(model, tokenizer, None, recipe, overrides, eval_data=data)
    model = call.model if call.model is not None else loading.load_base(call.recipe.model)
    tok = call.tokenizer or loading.load_tokenizer(call.recipe.model.path)
    causal = runtime.attends_causally(model)
    ev = call.recipe.evaluation

    def tasks_for(m):
        return Downstream(m, tok, tasks.spec_from_recipe(ev), causal, n_boot=max(ev.bootstrap, 1)) if ev.tasks else None

    tasks_of = tasks_for(model)  # unknown tasks, a missing extra, an unreachable dataset: before any compute
    windows = context.evaluation_windows(call.recipe, model, tok, causal, call.evaluation_texts)
    nll, count, _ = window_scores(model, windows, ev.batch_size, progress=progress, causal=causal)
    out = {"model": name, "perplexity": perplexity(nll, count), "windows": len(windows), "tokens": int(count.sum())}
    scores = tasks_of.scores() if tasks_of else None
    if base is not None:
        base_model = loading.load_base(call.recipe.model.model_copy(update={"path": str(base)})) \
            if isinstance(base, (str, Path)) else base
        out.update(_paired_perplexity(base, base_model, windows, (nll, count), ev, progress, causal))
        if tasks_of:
            out["tasks"] = tasks_of.paired(tasks_for(base_model).scores(), scores)
    elif scores is not None:
        out["tasks"] = accuracy.accuracy_ci(scores, n_boot=max(ev.bootstrap, 1), seed=ev.seed)
    return Evaluation(out)


def _rebuilt_run(path, base, recipe, allow_changed_base: bool) -> tuple:
    """A run folder rebuilt from its base model and plan: (pruned model, tokenizer, name, base, recipe), the base
    and recipe the run's unless given; refused when its base model changed (unless `allow_changed_base`)."""
    run = folders.load_run(Path(path))
    provenance.check_base(run.folder, run.recipe.model, allow_changed_base)
    recipe = recipe if recipe is not None else run.recipe
    compact = export.recovered(run) and run.metrics["surgery"] == "remove"  # no dense form of those weights
    pruned, tokenizer = export.rebuild(run, "compact" if compact else "dense")
    return pruned, tokenizer, str(path), base if base is not None else run.recipe.model.path, recipe


def _paired_perplexity(base, base_model, windows, scored: tuple, ev, progress: bool, causal: bool) -> dict:
    """The base's perplexity on the same windows and the paired change of `scored` (NLL sums, counts) from it."""
    from pruner.evaluation.perplexity import paired_delta, window_scores

    nll, count = scored
    b_nll, b_count, _ = window_scores(base_model, windows, ev.batch_size, progress=progress, causal=causal)
    d = paired_delta((b_nll, b_count), (nll, count), n_boot=max(ev.bootstrap, 1), seed=ev.seed)
    return {"base_model": str(base) if isinstance(base, (str, Path)) else IN_MEMORY, "base": d.base,
            "delta": d.delta, "ci_low": d.ci_low, "ci_high": d.ci_high}


def load(path, trust_remote_code: bool = False):
    """A model pruner wrote (a run's model/, an export) or any supported checkpoint, in eval mode.

    Per-layer compact checkpoints are built with pruner's own packaged modeling classes (pruner/modeling),
    never by running the modeling file in the folder; a config.json whose head counts do not fit the
    weights is refused in one line. Code shipped with any other checkpoint (`auto_map`) runs only with
    `trust_remote_code`."""
    return loading.load_model(str(path), trust_remote_code=trust_remote_code)


def export_run(run_dir, format: str = "compact", out=None, *, overwrite: bool = False, push_to_hub: str | None = None,
               private: bool = False, dtype: str | None = None, allow_changed_base: bool = False,
               quantize: str | None = None):
    """`pruner export`: a reload-checked checkpoint of a run folder (+ model card), optionally pushed to the Hub.

    `compact` is the vanilla form where the family's config can describe the pruned model, else the per-layer
    form (`trust_remote_code=True`, or `pruner.load`). `dtype` (auto|float32|float16|bfloat16) overrides the
    recipe's `export.dtype`; auto stores the base checkpoint's own dtype. `allow_changed_base`: export even
    when the base model is not the one the run was made from (the model card says so). `quantize` (gguf only,
    e.g. q4_k_m, q8_0): also the GGUF quantized by llama.cpp (llama-cpp-python), scored next to the float one."""
    if private and not push_to_hub:
        raise ValueError("private applies only with push_to_hub")
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / f"export-{format}"
    if push_to_hub:
        export.check_repo_id(push_to_hub)  # a malformed repo id fails before anything is read
    if folders.load_run(run_dir).recipe.model.path == IN_MEMORY:
        raise ValueError(f"{run_dir} was pruned from a model built in memory, so export cannot rebuild it from its "
                         f"base; its pruned model is in {run_dir / 'model'} (pruner.load reads it)")
    return export.export_run(run_dir, format, out, overwrite, export.Hub(push_to_hub, private),
                             allow_changed_base=allow_changed_base, dtype=dtype, quantize=quantize)
