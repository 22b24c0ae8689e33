"""The Python API: prune, compare and analyze a model you already hold, from a notebook or a script.

    import pruner
    plan = pruner.plan(model, tokenizer, texts, scorer="sink-aware", target=0.25)   # nothing changed yet
    pruner.apply(model, plan, compensation="refit", mode="remove")                   # in place
    result = pruner.prune(model, tokenizer, texts, target=0.25)                      # plan + apply + evaluate

Every function takes the model as an object (built in memory, fine-tuned,
wrapped: anything with a supported architecture) or as what a recipe's
`model.path` names (a shipped name, a local folder, a Hub id). Options are named
as the recipes name them: a recipe file, dict or `Recipe` (`recipe=`), API
keywords (`target=0.25`, `compensation="mean"`: `pruner.recipe.ALIASES`), whole
sections (`selection={"budget": "layer"}`) or dotted keys
(`**{"selection.gqa": "group"}`), all validated by the one recipe model with the
command line's one-line errors. The command line is a thin shell over these
functions, so the two cannot drift.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pruner import arch, distributed, export, models, pipeline, provenance, report, resources, resume, runs, surgery
from pruner.recipe import AnalyzeSpec, Recipe, RecipeError, build_recipe, validate_section
from pruner.selection import Plan

IN_MEMORY = "(in memory)"


# --------------------------------------------------------------------------- arguments -> recipe + objects

def _is_texts(data) -> bool:
    return isinstance(data, (list, tuple)) or hasattr(data, "column_names")  # texts, or a datasets.Dataset


def _texts(data, column: str) -> list[str]:
    """Texts given in memory: a list of strings or a `datasets.Dataset` (its `column`)."""
    if hasattr(data, "column_names"):
        if column not in data.column_names:
            raise ValueError(f"the dataset has no column {column!r}; columns: {', '.join(data.column_names)} "
                             "(set calibration.text_column)")
        data = data[column]
    texts = [t for t in data if isinstance(t, str) and t.strip()]
    if not texts:
        raise ValueError("no text given: pass a non-empty list of strings, a datasets.Dataset or a data source "
                         "such as 'shakespeare:calibration' or a local .txt file/folder")
    return texts


@dataclass
class _Call:
    """One API call resolved: the validated recipe and the objects and texts given in memory."""

    recipe: Recipe
    model: Any = None
    tokenizer: Any = None
    calibration_texts: list[str] | None = None
    evaluation_texts: list[str] | None = None

    def session(self, progress: bool, evaluation: bool = True,
                checkpoints: resume.Checkpoints = resume.NONE) -> pipeline.Session:
        return pipeline.prepare(self.recipe, progress, model=self.model, tokenizer=self.tokenizer,
                                calibration_texts=self.calibration_texts,
                                evaluation_texts=self.evaluation_texts, evaluation=evaluation,
                                checkpoints=checkpoints)

    def provenance(self, evaluation: bool = True) -> dict:
        """provenance.json of a run made by this call; the hashing is done once, by the first process."""
        ident = provenance.identity(self.recipe, model=self.model, tokenizer_given=self.tokenizer is not None,
                                    calibration_texts=self.calibration_texts,
                                    evaluation_texts=self.evaluation_texts, evaluation=evaluation) \
            if distributed.is_main() else None
        return provenance.record(self.recipe, distributed.all_objects(ident)[0])

    def checkpoints(self, folder, command: str, options: dict, prov: dict) -> resume.Checkpoints:
        """The resumable checkpoints in `folder` (None: none), refused if made by another setup."""
        if folder is None:
            return resume.NONE
        fp = resume.fingerprint(command, self.recipe.model_dump(mode="json"), options,
                                {k: prov[k] for k in ("model", "tokenizer", "data")})
        spec = self.recipe.checkpoint
        return resume.open_checkpoints(folder, fp, spec.every_batches, spec.every_seconds)


def _resolve(model, tokenizer, data, recipe, overrides: dict, eval_data=None,
             cli_overrides: list[str] = ()) -> _Call:
    """Model, tokenizer, data and options -> one validated recipe plus what is held in memory."""
    values = dict(overrides)
    held = None
    if isinstance(model, (str, Path)):
        values["model.path"] = str(model)
    elif model is not None:
        held = model
        arch.adapter_for(held)  # unsupported architecture: say so before anything else
    for key, given in (("calibration.data", data), ("evaluation.data", eval_data)):
        if isinstance(given, (str, Path)):
            values[key] = str(given)
    tree = recipe if recipe is not None else {}
    if held is not None and not _names_model(tree):
        values.setdefault("model.path", _name(held))
    r = build_recipe(tree, values, cli_overrides)
    tok = tokenizer
    if held is not None and tok is None:
        if r.model.path == IN_MEMORY:
            raise ValueError("pass the tokenizer: a model built in memory names no folder to load one from")
        tok = models.load_tokenizer(r.model.path, r.model.trust_remote_code)
    cal = _texts(data, r.calibration.text_column) if _is_texts(data) else None
    ev = _texts(eval_data, r.evaluation.text_column) if _is_texts(eval_data) else None
    return _Call(r, held, tok, cal, ev)


def _name(model) -> str:
    """What a model object is called in recipes and reports: its shipped name, its folder or Hub id, or
    "(in memory)" when it was built in memory."""
    path = getattr(model, "name_or_path", "") or ""
    return models.shipped_name(path) or path or IN_MEMORY


def _names_model(tree) -> bool:
    if isinstance(tree, Recipe):
        return True
    if isinstance(tree, dict):
        return bool((tree.get("model") or {}).get("path"))
    return True  # a recipe file: it must name its model (validated)


# --------------------------------------------------------------------------- plan / apply / prune

def plan(model=None, tokenizer=None, data=None, *, recipe=None, progress: bool = True, **overrides) -> Plan:
    """Calibrate and select: which heads to prune, and why. The model is not changed.

    `data`: calibration texts (a list of strings or a `datasets.Dataset`) or a data
    source (`"shakespeare:calibration"`, a local .txt file or folder, a Hub dataset
    id). The plan carries its calibration, so `apply` can compensate from it.
    """
    call = _resolve(model, tokenizer, data, recipe, overrides)
    return pipeline.make_plan(call.session(progress, evaluation=False), progress=progress)


def apply(model, plan: Plan, compensation: str = "refit", mode: str = "mask", ridge: float = 1e-3):
    """Prune `model` in place as `plan` says and return it.

    `mode`: `mask` zeroes the heads' output-projection columns (every shape kept),
    `remove` slices them out (smaller and faster). `compensation`: `mean` folds each
    pruned head's mean output over the plan's calibration into the output bias,
    `refit` refits the kept heads' output-projection columns to rebuild what the
    pruned ones wrote (ridge least squares, `ridge` relative; plain weights, no config
    change), `zero` does neither (the only choice for a plan read back from plan.json).
    """
    spec = validate_section("surgery", {"compensation": compensation, "mode": mode, "ridge": ridge})
    if plan.geometry is not None:
        geom = arch.geometry(model)
        if (geom.n_layers, geom.n_heads) != (plan.geometry.n_layers, plan.geometry.n_heads):
            raise ValueError(f"the plan is for {plan.geometry.n_layers} layers x {plan.geometry.n_heads} heads; "
                             f"this model has {geom.n_layers} x {geom.n_heads}")
    comp = pipeline.compensation(model, plan.heads, spec, plan.calibration)
    pipeline.apply(model, plan.heads, comp, spec.mode)
    return model


@dataclass
class Result:
    """What `prune` did: the pruned model, its plan, and the metrics `pruner prune` writes to metrics.json."""

    model: Any = field(repr=False)
    tokenizer: Any = field(repr=False)
    plan: Plan
    metrics: dict = field(repr=False)
    recipe: Recipe = field(repr=False)
    compensation: Any = field(default=None, repr=False)  # surgery.Compensation: what the pruned heads left behind
    provenance: dict | None = field(default=None, repr=False)  # provenance.json: what the run was made from

    @property
    def bias(self):
        """The folded biases {layer: (d_model,)} of the compensation, None when there are none."""
        return None if self.compensation is None else (self.compensation.bias or None)

    def save(self, folder, overwrite: bool = False) -> Path:
        """Write the run folder `pruner prune` writes (model/, plan.json, metrics.json, recipe.yaml, report.md,
        provenance.json)."""
        with report.atomic_dir(Path(folder), overwrite) as tmp:
            runs.save_run(self, tmp)
        return Path(folder)

    def __repr__(self) -> str:
        m, e = self.metrics, self.metrics["evaluation"]
        return (f"Result({m['model']}: {m['pruned_heads']}/{m['total_heads']} heads pruned by {m['scorer']}, "
                f"{m['compensation']} compensation, {m['surgery']}; perplexity {e['base']:.2f} -> {e['pruned']:.2f} "
                f"({e['delta']:+.2f} [{e['ci_low']:+.2f}, {e['ci_high']:+.2f}]))")


def prune(model=None, tokenizer=None, data=None, *, recipe=None, eval_data=None, progress: bool = True,
          checkpoint_dir=None, **overrides) -> Result:
    """`pruner prune` for a model object: plan, evaluate (paired with the unpruned model), apply in place.

    `eval_data`: evaluation texts or source (default: the recipe's, the shipped
    evaluation plays). `checkpoint_dir`: a folder where the calibration sums and
    finished evaluations are saved now and then (the recipe's `checkpoint` section);
    if it already holds those of an interrupted call with the same setup, this call
    continues from them and ends with the same result. Returns a `Result`;
    `result.save(folder)` writes the run folder.
    """
    call = _resolve(model, tokenizer, data, recipe, overrides, eval_data)
    return _prune(call, progress, checkpoint_dir)


def _prune(call: _Call, progress: bool, checkpoint_dir=None) -> Result:
    prov = call.provenance()
    checkpoints = call.checkpoints(checkpoint_dir, "prune", {}, prov)
    done = pipeline.run(call.session(progress, checkpoints=checkpoints), progress)
    return Result(done.model, done.tokenizer, done.plan, done.metrics, call.recipe, done.compensation, prov)


# --------------------------------------------------------------------------- compare

@dataclass
class Comparison:
    """Every scorer x sparsity x compensation (x budget x GQA mode) on the same evaluation windows."""

    records: list[dict] = field(repr=False)
    recipe: Recipe = field(repr=False)
    provenance: dict | None = field(default=None, repr=False)

    def table(self) -> str:
        """Markdown: perplexity change [95% CI] per scorer (rows) and sparsity x compensation (columns)."""
        return report.compare_table(self.records)

    def save(self, folder, overwrite: bool = False) -> Path:
        """compare.json, .csv, .md, .png and the resolved recipe."""
        with report.atomic_dir(Path(folder), overwrite) as tmp:
            self.write(tmp)
        return Path(folder)

    def write(self, folder: Path) -> str:
        """The files of `save` into an existing folder; returns the table."""
        if self.provenance:
            provenance.write(folder, self.provenance)
        return report.write_compare(self.records, self.recipe, folder)

    def __repr__(self) -> str:
        ok = [r for r in self.records if "error" not in r]
        if not ok:
            return f"Comparison({len(self.records)} plans, none feasible)"
        best = min(ok, key=lambda r: r["delta"])
        return (f"Comparison({len(ok)} plans on {ok[0]['windows']} windows, base perplexity {ok[0]['base']:.2f}; "
                f"smallest change {best['delta']:+.2f}: {best['scorer']} @ {best['sparsity']:g}, "
                f"{best['compensation']})")


COMPENSATIONS = surgery.COMPENSATIONS


def compare(model=None, tokenizer=None, data=None, *, recipe=None, scorers=None, sparsities=(0.1, 0.25, 0.4, 0.5),
            compensations=("zero", "mean", "refit"), budgets=None, gqa=None, eval_data=None, progress: bool = True,
            checkpoint_dir=None, **overrides) -> Comparison:
    """`pruner compare` for a model object: one calibration pass, every combination evaluated with a scoped mask.

    `scorers` default to all registered; `budgets` (`layer`, `global`) and `gqa`
    (`equal`, `group`) default to the recipe's single choice. `checkpoint_dir`: as
    for `prune`; each finished plan's evaluation is kept too, so a resumed compare
    evaluates only what is left.
    """
    call = _resolve(model, tokenizer, data, recipe, overrides, eval_data)
    return _compare(call, scorers, sparsities, compensations, budgets, gqa, progress, checkpoint_dir)


def _compare(call: _Call, scorers, sparsities, compensations, budgets, gqa, progress: bool,
             checkpoint_dir=None) -> Comparison:
    from pruner.scoring import SCORERS, get_scorer

    scorers = list(scorers or SCORERS)
    for name in scorers:
        get_scorer(name)
    _check_choices("compensation", compensations, COMPENSATIONS)
    _check_choices("budget", budgets or (), ("global", "layer"))
    _check_choices("gqa", gqa or (), ("equal", "group"))
    targets = [_target(t) for t in sparsities]
    prov = call.provenance()
    options = {"scorers": scorers, "sparsities": targets, "compensations": list(compensations),
               "budgets": list(budgets or []), "gqa": list(gqa or [])}
    checkpoints = call.checkpoints(checkpoint_dir, "compare", options, prov)
    records = pipeline.compare(call.session(progress, checkpoints=checkpoints), scorers, targets, list(compensations),
                               list(budgets) if budgets else None, list(gqa) if gqa else None, progress)
    return Comparison(records, call.recipe, prov)


def _check_choices(what: str, given, valid: tuple[str, ...]) -> None:
    bad = [c for c in given if c not in valid]
    if bad:
        raise ValueError(f"unknown {what} {bad}; valid: {', '.join(valid)}")


def _target(value) -> float:
    """A sparsity as the recipe's selection.target: a fraction in (0, 1) or a whole head count."""
    from pruner.recipe import SelectionSpec

    try:
        return SelectionSpec(target=value).target
    except Exception:  # noqa: BLE001 - pydantic/ValueError: one message for every bad value
        raise ValueError(f"sparsity {value!r} is neither a fraction in (0, 1) nor a whole head count") from None


# --------------------------------------------------------------------------- analyze

@dataclass
class Analysis:
    """The convention audit of one model: the content of analysis.json, plus the statistics behind it.

    Keys of `data` are documented in the README (`pruner analyze`); the common ones
    are attributes: `heads`, `entropy`, `audit`, `clustering`, `entropy_attribution`.
    """

    data: dict = field(repr=False)
    stats: Any = field(default=None, repr=False)      # pruner.stats.HeadStats of the model
    reference: Any = field(default=None, repr=False)  # of `compare_to`, when given
    provenance: dict | None = field(default=None, repr=False)  # what the analysis was made from

    heads = property(lambda self: self.data["heads"])
    entropy = property(lambda self: self.data["entropy"])
    audit = property(lambda self: self.data["audit"])
    clustering = property(lambda self: self.data["clustering"])
    entropy_attribution = property(lambda self: self.data.get("entropy_attribution"))

    def to_dict(self) -> dict:
        return self.data

    def to_json(self) -> str:
        return json.dumps(self.data, indent=1) + "\n"

    def figures(self, folder) -> list[str]:
        """Draw the figures (PNG) into `folder`; returns their file names."""
        from pruner import analysis_report as ar

        Path(folder).mkdir(parents=True, exist_ok=True)
        return ar.write_figures(self.data, Path(folder))

    def write(self, folder: Path) -> list[str]:
        """analysis.json, report.md and the figures into an existing folder; returns the figure names."""
        from pruner import analysis_report as ar

        (folder / "analysis.json").write_text(self.to_json())
        if self.provenance:
            provenance.write(folder, self.provenance)
        figures = self.figures(folder)
        (folder / "report.md").write_text(ar.report_markdown(self.data, figures))
        return figures

    def save(self, folder, overwrite: bool = False) -> Path:
        with report.atomic_dir(Path(folder), overwrite) as tmp:
            self.write(tmp)
        return Path(folder)

    def __repr__(self) -> str:
        d = self.data
        parts = [f"{m} NN flip {a['overall']['nn_flip_rate']:.2f}, pair-order flip "
                 f"{a['overall']['pair_order_flip_rate']:.2f}" for m, a in d["audit"].items()]
        attr = d.get("entropy_attribution")
        if attr:
            parts.append(f"entropy change sink share {attr['overall']['sink_share']:.2f}")
        return f"Analysis({d['model']}: {d['n_layers']}x{d['n_heads']} heads; " + "; ".join(parts) + ")"


def _model_and_tokenizer(model, tokenizer, trust_remote_code: bool = False):
    """(model object, tokenizer, name) from an object or a name/path."""
    if isinstance(model, (str, Path)):
        loaded = models.load_model(str(model), trust_remote_code=trust_remote_code)
        arch.adapter_for(loaded)  # e.g. a per-layer checkpoint: no single head count to measure
        return loaded, tokenizer or models.load_tokenizer(str(model), trust_remote_code), str(model)
    arch.adapter_for(model)
    if tokenizer is None:
        raise ValueError("pass the tokenizer with a model object")
    return model, tokenizer, _name(model)


def measure_heads(model, tokenizer=None, data=None, *, metrics=("cosine",), across_layers: bool = False,
                  progress: bool = True, checkpoints: resume.Checkpoints = resume.NONE, **options):
    """Capture per-head statistics of `model` on `data` (what `pruner sinks` prints and `analyze` audits).

    Returns (model, tokenizer, name, HeadStats, samples, unit, sink spec, options).
    """
    import torch

    from pruner import data as data_mod
    from pruner.capture import CaptureConfig, capture_stats, resolve_auto_sinks
    from pruner.sinks import check_content, parse_spec

    opts = AnalyzeSpec.validated({**options, "metrics": list(metrics)})
    if opts.threads:
        torch.set_num_threads(opts.threads)
    model, tokenizer, name = _model_and_tokenizer(model, tokenizer, opts.trust_remote_code)
    causal = models.attends_causally(model)
    unit = opts.unit or ("windows" if causal else "lines")
    texts = _texts(data, "text") if _is_texts(data) else \
        data_mod.load_texts(data_mod.TextSource(str(data or "shakespeare:evaluation")))
    batch = data_mod.samples(tokenizer, texts, unit, opts.max_length, bos=opts.bos, num_samples=opts.num_samples,
                             seed=opts.seed)
    spec = parse_spec(opts.sinks, causal)
    if spec.mode == "auto":
        spec = resolve_auto_sinks(model, batch, tokenizer, eps=spec.eps, batch_size=opts.batch_size,
                                  checkpoints=checkpoints)
        print(f"auto sinks (eps {spec.eps}): positions {list(spec.positions)}, token ids {list(spec.ids)}")
    check_content(batch.input_ids, batch.attention_mask, spec, tokenizer)
    config = CaptureConfig(chunk_size=opts.chunk_size, metrics=tuple(opts.metrics), across_layers=across_layers)
    if opts.memory_check:
        resources.check_memory(model, resources.Sizes(
            batch_size=min(opts.batch_size, len(batch)), length=batch.input_ids.shape[1], chunk_size=opts.chunk_size,
            pair_metrics=len(opts.metrics), outputs=False, across_layers=across_layers), what="the capture")
    stats = capture_stats(model, batch, spec, tokenizer, config, batch_size=opts.batch_size, progress=progress,
                          checkpoints=checkpoints)
    return model, tokenizer, name, stats, batch, unit, spec, opts


def analyze(model, tokenizer=None, data=None, *, compare_to=None, progress: bool = True, checkpoint_dir=None,
            **options) -> Analysis:
    """`pruner analyze` for a model object: every head against every head, sink included vs removed.

    Options as the command's flags: `metrics` (default cosine, js), `sinks`, `unit`,
    `max_length`, `num_samples`, `thresholds` ({metric: t}), `clusters`, `seed`,
    `batch_size`, `chunk_size`, `bos`, `threads`, `trust_remote_code`. `compare_to`
    (a paired state with the same tokenizer) adds the entropy attribution. `data`
    defaults to the shipped evaluation plays. `checkpoint_dir`: as for `prune`
    (cadence: `checkpoint_every_seconds` / `checkpoint_every_batches`).
    """
    import dataclasses

    from pruner import __version__
    from pruner import analysis
    from pruner.capture import CaptureConfig, capture_stats

    options.setdefault("metrics", ["cosine", "js"])
    given = AnalyzeSpec.validated(options)  # bad options fail before any model is loaded
    prov = _analysis_provenance(model, compare_to, data, given)
    checkpoints = resume.NONE if checkpoint_dir is None else resume.open_checkpoints(
        checkpoint_dir, resume.fingerprint("analyze", None, {**given.model_dump(mode="json"), **dict.fromkeys(
            ("threads", "memory_check", "checkpoint_every_seconds", "checkpoint_every_batches"))}, prov["identity"]),
        given.checkpoint_every_batches, given.checkpoint_every_seconds)
    model, tokenizer, name = _model_and_tokenizer(model, tokenizer, given.trust_remote_code)
    reference = ref_name = None
    if compare_to is not None:  # checked before any compute
        reference, ref_tok, ref_name = _model_and_tokenizer(compare_to, tokenizer if not isinstance(
            compare_to, (str, Path)) else None, given.trust_remote_code)
        _same_tokenizer(tokenizer, ref_tok, (name, ref_name))
        shape = lambda m: (arch.geometry(m).n_layers, arch.geometry(m).n_heads)  # noqa: E731
        if shape(model) != shape(reference):
            raise ValueError(f"--compare-to needs the same layers x heads: {name} has {shape(model)}, "
                             f"{ref_name} {shape(reference)}")
    model, tokenizer, _, stats, batch, unit, spec, opts = measure_heads(
        model, tokenizer, data, across_layers=True, progress=progress, checkpoints=checkpoints, **options)
    config = analysis.AnalysisConfig(metrics=tuple(opts.metrics), thresholds=dict(opts.thresholds),
                                     clusters=opts.clusters, seed=opts.seed)
    res = {"pruner_version": __version__, "model": name, "compare_to": ref_name,
           "n_layers": int(stats.sink_mass.shape[0]), "n_heads": int(stats.sink_mass.shape[1]),
           "metrics": list(config.metrics),
           "sinks": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(spec).items()},
           "data": {"source": "(in memory)" if _is_texts(data) else str(data or "shakespeare:evaluation"),
                    "unit": unit, "samples": len(batch), "max_length": opts.max_length, "seed": opts.seed,
                    "query_rows": int(stats.rows[0]), "content_rows": int(stats.content_rows[0]),
                    "excluded_rows": int(stats.excluded_rows[0])}}
    res.update(analysis.analyze(stats, config))
    ref_stats = None
    if reference is not None:
        ref_stats = capture_stats(reference, batch, spec, tokenizer, CaptureConfig(chunk_size=opts.chunk_size,
                                                                                  metrics=()),
                                  batch_size=opts.batch_size, progress=progress, checkpoints=checkpoints,
                                  name="reference")
        res["entropy_attribution"] = {"reference": ref_name, **analysis.entropy_attribution(ref_stats, stats),
                                      "reference_heads": analysis.head_tables(ref_stats)}
    return Analysis(res, stats, ref_stats, prov)


def _analysis_provenance(model, compare_to, data, opts: AnalyzeSpec) -> dict:
    """What an analysis is made from: the model(s) (files or object hash) and the data; by the first process."""
    import torch
    import transformers

    from pruner import __version__

    def ident(m):
        return provenance.model_identity(str(m)) if isinstance(m, (str, Path)) else \
            provenance.object_identity(m, _name(m))
    out = None
    if distributed.is_main():
        out = {"model": ident(model), "compare_to": None if compare_to is None else ident(compare_to),
               "data": provenance.texts_identity(_texts(data, "text")) if _is_texts(data)
               else provenance.data_identity(str(data or "shakespeare:evaluation"))}
    out = distributed.all_objects(out)[0]
    return {"pruner_version": __version__, "pruner_source_sha256": provenance.source_hash(),
            "environment": {"torch": torch.__version__, "transformers": transformers.__version__},
            "identity": out, "options": opts.model_dump(mode="json")}


def _same_tokenizer(a, b, names: tuple[str, str]) -> None:
    if a.get_vocab() != b.get_vocab() or a.all_special_ids != b.all_special_ids:
        raise ValueError(f"--compare-to needs the same tokenizer (the same token rows): {names[0]} and "
                         f"{names[1]} tokenise differently")


# --------------------------------------------------------------------------- evaluate / load / export

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
        from pruner.tasks import accuracy_table

        return accuracy_table(self.metrics.get("tasks", {}))


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
    from pruner import tasks
    from pruner.perplexity import paired_delta, perplexity, window_scores

    if isinstance(model, (str, Path)) and (Path(model) / "plan.json").exists():
        run = export.load_run(Path(model))
        provenance.check_base(run.folder, run.recipe.model, allow_changed_base)
        recipe = recipe if recipe is not None else run.recipe
        pruned, tokenizer = export.rebuild(run, "dense")
        name, base = str(model), base if base is not None else run.recipe.model.path
        model = pruned
    else:
        name = str(model) if isinstance(model, (str, Path)) else _name(model)
    call = _resolve(model, tokenizer, None, recipe, overrides, eval_data=data)
    model = call.model if call.model is not None else models.load_base(call.recipe.model)
    tok = call.tokenizer or models.load_tokenizer(call.recipe.model.path)
    causal = models.attends_causally(model)
    ev = call.recipe.evaluation
    downstream = lambda m: tasks.Downstream(m, tok, tasks.spec_from_recipe(ev), causal,  # noqa: E731
                                            n_boot=max(ev.bootstrap, 1)) if ev.tasks else None
    tasks_of = downstream(model)  # unknown tasks, a missing extra, an unreachable dataset: before any compute
    windows = pipeline.evaluation_windows(call.recipe, model, tok, causal, call.evaluation_texts)
    nll, count, _ = window_scores(model, windows, ev.batch_size, progress=progress, causal=causal)
    out = {"model": name, "perplexity": perplexity(nll, count), "windows": len(windows), "tokens": int(count.sum())}
    scores = tasks_of.scores() if tasks_of else None
    if base is not None:
        base_model = models.load_base(call.recipe.model.model_copy(update={"path": str(base)})) \
            if isinstance(base, (str, Path)) else base
        b_nll, b_count, _ = window_scores(base_model, windows, ev.batch_size, progress=progress, causal=causal)
        d = paired_delta((b_nll, b_count), (nll, count), n_boot=max(ev.bootstrap, 1), seed=ev.seed)
        out.update({"base_model": str(base) if isinstance(base, (str, Path)) else IN_MEMORY, "base": d.base,
                    "delta": d.delta, "ci_low": d.ci_low, "ci_high": d.ci_high})
        if tasks_of:
            out["tasks"] = tasks_of.paired(downstream(base_model).scores(), scores)
    elif scores is not None:
        out["tasks"] = tasks.accuracy_ci(scores, n_boot=max(ev.bootstrap, 1), seed=ev.seed)
    return Evaluation(out)


def load(path, trust_remote_code: bool = False):
    """A model pruner wrote (a run's model/, an export) or any supported checkpoint, in eval mode.

    Per-layer compact checkpoints are built with pruner's own packaged modeling classes (pruner/modeling),
    never by running the modeling file in the folder; a config.json whose head counts do not fit the
    weights is refused in one line. Code shipped with any other checkpoint (`auto_map`) runs only with
    `trust_remote_code`."""
    return models.load_model(str(path), trust_remote_code=trust_remote_code)


def export_run(run_dir, format: str = "compact", out=None, *, overwrite: bool = False, push_to_hub: str | None = None,
               private: bool = False, dtype: str | None = None, allow_changed_base: bool = False):
    """`pruner export`: a reload-checked checkpoint of a run folder (+ model card), optionally pushed to the Hub.

    `compact` is the vanilla form where the family's config can describe the pruned model, else the per-layer
    form (`trust_remote_code=True`, or `pruner.load`). `dtype` (auto|float32|float16|bfloat16) overrides the
    recipe's `export.dtype`; auto stores the base checkpoint's own dtype. `allow_changed_base`: export even
    when the base model is not the one the run was made from (the model card says so)."""
    if private and not push_to_hub:
        raise ValueError("private applies only with push_to_hub")
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / f"export-{format}"
    if push_to_hub:
        export.check_repo_id(push_to_hub)  # a malformed repo id fails before anything is read
    if export.load_run(run_dir).recipe.model.path == IN_MEMORY:
        raise ValueError(f"{run_dir} was pruned from a model built in memory, so export cannot rebuild it from its "
                         f"base; its pruned model is in {run_dir / 'model'} (pruner.load reads it)")
    return export.export_run(run_dir, format, out, overwrite, repo_id=push_to_hub, private=private,
                             allow_changed_base=allow_changed_base, dtype=dtype)


__all__ = ["plan", "apply", "prune", "compare", "analyze", "evaluate", "load", "export_run",
           "Plan", "Result", "Comparison", "Analysis", "Evaluation", "Recipe", "RecipeError"]
