"""`analyze` (the convention audit) and `measure_heads` (what `pruner sinks` prints) on a model you hold or name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pruner.api.arguments import is_texts, model_and_tokenizer, model_name, same_tokenizer, texts_of
from pruner.core import arch, distributed, environment, outputs, resume, runtime
from pruner.runs import provenance, resources
from pruner.runs.analyze_spec import AnalyzeSpec


@dataclass
class Analysis:
    """The convention audit of one model: the content of analysis.json, plus the statistics behind it.

    Keys of `data` are documented in docs/convention-audit.md (`pruner analyze`); the common ones
    are attributes: `heads`, `entropy`, `audit`, `clustering`, `entropy_attribution`.
    """

    data: dict = field(repr=False)
    stats: Any = field(default=None, repr=False)      # pruner.attention.sums.HeadStats of the model
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
        from pruner.analysis import report as ar

        Path(folder).mkdir(parents=True, exist_ok=True)
        return ar.write_figures(self.data, Path(folder))

    def write(self, folder: Path) -> list[str]:
        """analysis.json, report.md and the figures into an existing folder; returns the figure names."""
        from pruner.analysis import report as ar

        (folder / "analysis.json").write_text(self.to_json())
        if self.provenance:
            provenance.write(folder, self.provenance)
        figures = self.figures(folder)
        (folder / "report.md").write_text(ar.report_markdown(self.data, figures))
        return figures

    def save(self, folder, overwrite: bool = False) -> Path:
        with outputs.atomic_dir(Path(folder), overwrite) as tmp:
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


def measure_heads(model, tokenizer=None, data=None, *, metrics=("cosine",), across_layers: bool = False,
                  progress: bool = True, checkpoints: resume.Checkpoints = resume.NONE, **options):
    """Capture per-head statistics of `model` on `data` (what `pruner sinks` prints and `analyze` audits).

    Returns (model, tokenizer, name, HeadStats, samples, unit, sink spec, options).
    """
    import torch

    from pruner.attention.capture import CaptureConfig, capture_stats, resolve_auto_sinks
    from pruner.attention.sinks import check_content, parse_spec
    from pruner.core import data as data_mod

    opts = AnalyzeSpec.validated({**options, "metrics": list(metrics)})
    if opts.threads:
        torch.set_num_threads(opts.threads)
    model, tokenizer, name = model_and_tokenizer(model, tokenizer, opts.trust_remote_code)
    causal = runtime.attends_causally(model)
    unit = opts.unit or ("windows" if causal else "lines")
    texts = texts_of(data, "text") if is_texts(data) else \
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

    from pruner.analysis import convention
    from pruner.attention.capture import Capture, CaptureConfig
    from pruner.core.version import __version__

    options.setdefault("metrics", ["cosine", "js"])
    given = AnalyzeSpec.validated(options)  # bad options fail before any model is loaded
    prov = _analysis_provenance(model, compare_to, data, given)
    checkpoints = _analysis_checkpoints(checkpoint_dir, given, prov)
    model, tokenizer, name = model_and_tokenizer(model, tokenizer, given.trust_remote_code)
    reference = ref_name = None
    if compare_to is not None:  # checked before any compute
        reference, ref_name = _reference(compare_to, model, tokenizer, name, given)
    model, tokenizer, _, stats, batch, unit, spec, opts = measure_heads(
        model, tokenizer, data, across_layers=True, progress=progress, checkpoints=checkpoints, **options)
    config = convention.AnalysisConfig(metrics=tuple(opts.metrics), thresholds=dict(opts.thresholds),
                                       clusters=opts.clusters, seed=opts.seed)
    res = {"pruner_version": __version__, "model": name, "compare_to": ref_name,
           "n_layers": int(stats.sink_mass.shape[0]), "n_heads": int(stats.sink_mass.shape[1]),
           "metrics": list(config.metrics),
           "sinks": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(spec).items()},
           "data": {"source": "(in memory)" if is_texts(data) else str(data or "shakespeare:evaluation"),
                    "unit": unit, "samples": len(batch), "max_length": opts.max_length, "seed": opts.seed,
                    "query_rows": int(stats.rows[0]), "content_rows": int(stats.content_rows[0]),
                    "excluded_rows": int(stats.excluded_rows[0])}}
    res.update(convention.analyze(stats, config))
    ref_stats = None
    if reference is not None:
        with Capture(reference, spec, tokenizer, CaptureConfig(chunk_size=opts.chunk_size, metrics=())) as cap:
            cap.run(batch, batch_size=opts.batch_size, progress=progress, checkpoints=checkpoints, name="reference")
        ref_stats = cap.result()
        res["entropy_attribution"] = {"reference": ref_name, **convention.entropy_attribution(ref_stats, stats),
                                      "reference_heads": convention.head_tables(ref_stats)}
    return Analysis(res, stats, ref_stats, prov)


def _analysis_checkpoints(checkpoint_dir, given: AnalyzeSpec, prov: dict) -> resume.Checkpoints:
    """Where a resumable analysis keeps its stages (none without `checkpoint_dir`), fingerprinted by its options
    less those that do not change its numbers."""
    return resume.NONE if checkpoint_dir is None else resume.open_checkpoints(
        checkpoint_dir, resume.fingerprint("analyze", None, {**given.model_dump(mode="json"), **dict.fromkeys(
            ("threads", "memory_check", "checkpoint_every_seconds", "checkpoint_every_batches"))}, prov["identity"]),
        given.checkpoint_every_batches, given.checkpoint_every_seconds)


def _reference(compare_to, model, tokenizer, name: str, given: AnalyzeSpec) -> tuple:
    """`compare_to` loaded (with `tokenizer` when it is an object): (reference model, its name); refused unless it
    has the same tokenizer and layers x heads as `model`."""
    reference, ref_tok, ref_name = model_and_tokenizer(compare_to, tokenizer if not isinstance(
        compare_to, (str, Path)) else None, given.trust_remote_code)
    same_tokenizer(tokenizer, ref_tok, (name, ref_name))

    def shape(m):
        return (arch.geometry(m).n_layers, arch.geometry(m).n_heads)

    if shape(model) != shape(reference):
        raise ValueError(f"--compare-to needs the same layers x heads: {name} has {shape(model)}, "
                         f"{ref_name} {shape(reference)}")
    return reference, ref_name


def _analysis_provenance(model, compare_to, data, opts: AnalyzeSpec) -> dict:
    """What an analysis is made from: the model(s) (files or object hash) and the data; by the first process."""
    def ident(m):
        return provenance.model_identity(str(m)) if isinstance(m, (str, Path)) else \
            provenance.object_identity(m, model_name(m))
    out = None
    if distributed.is_main():
        out = {"model": ident(model), "compare_to": None if compare_to is None else ident(compare_to),
               "data": provenance.texts_identity(texts_of(data, "text")) if is_texts(data)
               else provenance.data_identity(str(data or "shakespeare:evaluation"))}
    out = distributed.all_objects(out)[0]
    return {**environment.record(), "identity": out, "options": opts.model_dump(mode="json")}
