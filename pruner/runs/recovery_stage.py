"""The recovery stage: distil the run's base model into its pruned model, and write what it did.

Three routes share `recover_models`: `pruner prune` with `recovery.enabled` (after the
surgery, on the pruned model still in memory: `stage`), `pruner recover RUN_DIR`
(`recover_run`: the run folder's model/ as the student, its base as the teacher, a new
run folder as the output) and `pruner.recover` (objects the caller holds). Everything that
can be refused -- a run without a pruned model, an unknown method, a budget below one
batch, data overlapping the evaluation windows, a base that is no longer the run's, a disk
too small for the teacher cache -- is refused in one line before the teacher is run, and
the output folder is written only when the recovery is complete.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from pruner.checkpoints import loading
from pruner.core import distributed, mixture, resume, runtime
from pruner.core.host_memory import reuse_buffers
from pruner.evaluation.perplexity import (
    BlockwisePass,
    EvalWindows,
    pair_scores,
    paired_delta,
    perplexity,
    window_scores,
)
from pruner.recovery import data as rdata
from pruner.recovery import teacher as rteacher
from pruner.recovery.spec import GENERATED, RecoverySpec
from pruner.recovery.train import Options, train
from pruner.runs import folders, provenance, recovery_memory, report
from pruner.runs.context import sequential_folder

CACHE = "recovery-cache"        # in the run folder: the teacher's generated windows
TEACHER_CACHE = "teacher-cache"  # in the partial output folder while it trains: the top-k cache


@dataclass
class Recovered:
    """What `recover_models` returns: the recovered (or, when it did not help, pruned) model and its record."""

    model: object
    record: dict


def check(spec: RecoverySpec, evaluation=None, cache_folder: Path | None = None) -> tuple[int, int]:
    """Every refusal that needs no model: budget, overlap, cache disk. Returns (train, validation) windows."""
    n_train, n_val = rdata.counts(spec)
    if evaluation is not None:
        rdata.check_overlap(spec, evaluation)
    if spec.teacher == "cached" and cache_folder is not None:
        rteacher.check_disk(Path(cache_folder), rteacher.cache_bytes(n_train + n_val, spec.length, spec.top_k,
                                                                     spec.tail_samples))
    return n_train, n_val


def _nll(model, windows: EvalWindows, batch_size: int = 8, onloader=None):
    return window_scores(model, windows, batch_size, causal=True,
                         blocks=BlockwisePass(onloader, "cpu" if onloader is None else onloader.device))[:2]


def scores(teacher, model, windows: EvalWindows | None, teacher_onloader=None, base: bool = True):
    """On the evaluation windows: (the teacher's (NLL, count), or None without `base`; the model's (NLL, count);
    KL(teacher || model) per token -- distillation's own objective, on text it never trained on), from one pass of
    each model. A teacher read a block at a time (`teacher_onloader`) has no logits whole: its NLL from a pass of
    its own, no KL. All None without windows."""
    if windows is None:
        return None, None, None
    if teacher_onloader is not None:
        return _nll(teacher, windows, onloader=teacher_onloader) if base else None, _nll(model, windows), None
    p = pair_scores(teacher, model, windows)
    return (p.teacher_nll, p.count) if base else None, (p.model_nll, p.count), p.kl


def _targets(spec: RecoverySpec, teacher, windows: rdata.Windows, folder: Path | None, progress: bool,
             onloader=None):
    if spec.teacher == "resident":
        return rteacher.Resident(teacher, spec.temperature)
    every = mixture.concat([windows.train, windows.validation])  # the cache holds both: (train + validation, length)
    folder = Path(folder) / f"rank-{distributed.rank()}"  # several processes: one cache each, no shared writes
    return rteacher.Cached.build(teacher, every, folder,
                                 rteacher.CacheSpec(spec.top_k, spec.temperature, spec.tail_samples, spec.seed),
                                 spec.batch_size, progress, onloader)


def check_layerwise_teacher(spec: RecoverySpec) -> None:
    """A teacher read a block at a time (always a `cached` one: a resident teacher is loaded whole) can fill the
    cache, not sample text."""
    if GENERATED in spec.sources:
        raise rdata.RecoveryError("recovery.data: generated samples text from the whole teacher, which this run "
                                  "reads a block at a time (capture.onload: sequential); name a data source "
                                  "(e.g. shakespeare:train) or set capture.onload: all")


@dataclass(frozen=True)
class RecoveryText:
    """Where `recover_models`' text comes from, and where what is made of it is cached."""

    texts: list[str] | None = None     # the recovery text given in memory (instead of `spec.data`)
    data_cache: Path | None = None     # the generated-data cache folder; None: none
    teacher_cache: Path | None = None  # the teacher-cache folder; None: a temporary one
    identity: dict | None = None       # the base's identity, which the generated-data cache is keyed by


@dataclass(frozen=True)
class TeacherAccess:
    """How `recover_models` holds the teacher; the default: whole in memory throughout.

    `onloader`: the teacher's blocks stay in its checkpoint and its passes (the cache, the base perplexity) run a
    block at a time (`cached` only; the base's task accuracy, which needs the whole model, is then not measured).
    `reload`: reads the teacher again; given, a `cached` teacher's weights are freed while the student trains (the
    caller holds no other use of them) and read again for the scores after.
    """

    onloader: object = None
    reload: Callable[[], object] | None = None


@dataclass(frozen=True)
class Measures:
    """What `recover_models` measures on the models before and after."""

    evaluation: EvalWindows | None = None  # perplexity (and KL to the teacher) before and after
    tasks: object = None                   # a `TaskSpec`: downstream accuracy of the base, pruned and recovered


def recover_models(student, teacher, tokenizer, spec: RecoverySpec, *, text: RecoveryText = RecoveryText(),
                   measures: Measures = Measures(), options: Options | None = None,
                   access: TeacherAccess = TeacherAccess()) -> Recovered:
    """Distil `teacher` into `student` (same tokenizer) as `spec` says, on `text`; perplexity before and after on
    `measures.evaluation` when given, and the downstream `measures.tasks` of the base, pruned and recovered models
    when given. `access`: how the teacher is held (`TeacherAccess`). The method is decided and its memory checked
    before any text is sampled (`recovery_memory`)."""
    options = options or Options()
    onloader, evaluation, tasks = access.onloader, measures.evaluation, measures.tasks
    if onloader is None and runtime.input_device(student).type == "cpu":
        reuse_buffers()  # the same large buffers every step: reused, not mapped afresh (pruner.core.host_memory)
    _check_pair(student, teacher)
    n_train, n_val = check(spec)
    release = spec.teacher == "cached" and onloader is None and access.reload is not None
    spec, est, choice = recovery_memory.choose(student, teacher, spec, teacher_held=not release and
                                               onloader is None,
                                               teacher_bytes=0 if onloader is not None else None)
    if choice and options.progress and distributed.is_main():
        tqdm.write(choice)
    windows = rdata.from_source(spec, tokenizer, n_train, n_val, text.texts, generate=lambda t, v: rdata.generated(
        spec, teacher, tokenizer, t, v, text.data_cache, text.identity or {}, options.progress))
    base, before, kl_before = scores(teacher, student, evaluation, onloader)
    task_base = None if not tasks or onloader is not None else _task_scores(tasks, teacher, tokenizer)
    task_before = _task_scores(tasks, student, tokenizer) if tasks else None
    done, teacher = _distil(student, teacher, spec, windows, text.teacher_cache, options, access, release)
    record = {"method": spec.method, "teacher": spec.teacher,
              "data": "(texts in memory)" if text.texts else windows.source, "epochs": windows.epochs,
              "budget": spec.tokens, "seed": spec.seed, "spec": spec.model_dump(mode="json"),
              "memory_estimate": est.parts, **done.record}
    if choice:
        record["note"] = "; ".join(filter(None, [choice, record.get("note")]))
    if evaluation is not None:
        _, after, kl_after = scores(teacher, done.model, evaluation, onloader, base=False)
        record["perplexity"] = {**perplexity_record(base, before, after), **divergence_record(kl_before, kl_after)}
    if tasks:
        record["tasks"] = tasks_record(task_base, task_before, _task_scores(tasks, done.model, tokenizer), tasks.seed)
    return Recovered(done.model, record)


def _check_pair(student, teacher) -> None:
    """Recovery distils a decoder from the model it was pruned from: refused for an encoder or another vocabulary."""
    if not runtime.attends_causally(student):
        raise rdata.RecoveryError("recovery distils next-token distributions: it is for decoders; this model "
                                  "attends both ways")
    if teacher.config.vocab_size != student.config.vocab_size:
        raise rdata.RecoveryError(f"the teacher's vocabulary ({teacher.config.vocab_size}) is not the student's "
                                  f"({student.config.vocab_size}): not the model it was pruned from")


def _distil(student, teacher, spec: RecoverySpec, windows: rdata.Windows, cache: Path | None, options: Options,
            access: TeacherAccess, release: bool):
    """The teacher's targets (in `cache`, or a temporary folder, removed after), then the training. With `release`
    the teacher's weights go while the student trains and are read again after. Returns (what `train` returns,
    the teacher)."""
    tmp = cache or Path(tempfile.mkdtemp(prefix="pruner-teacher-cache-"))
    try:
        targets = _targets(spec, teacher, windows, tmp, options.progress, access.onloader)
        if release:  # training holds only the student: the teacher's weights go, and are read again after
            teacher = teacher.to("meta")
            gc.collect()
        done = train(student, targets, windows, spec, options)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if release:
        teacher = access.reload()
    return done, teacher


def _task_scores(tasks, model, tokenizer) -> dict:
    from pruner.evaluation import downstream

    return downstream.Downstream(model, tokenizer, tasks, causal=True).scores()


def tasks_record(base: dict | None, pruned: dict, recovered: dict, seed: int = 0, n_boot: int = 1000) -> dict:
    """{task: {metric: {base, pruned, recovered, delta, ci_low, ci_high, docs}}}: the accuracy of the three models
    on the same documents (base None where it was not measured), and the paired change recovery made
    (recovered - pruned) with its bootstrap CI."""
    from pruner.evaluation.accuracy import paired_accuracy

    out: dict[str, dict[str, dict]] = {}
    for name, p in pruned.items():
        of_base = {} if base is None else \
            {d.metric: d.base for d in paired_accuracy(base[name], p, n_boot=1, seed=seed)}
        for d in paired_accuracy(p, recovered[name], n_boot=n_boot, seed=seed):
            out.setdefault(name, {})[d.metric] = {"base": of_base.get(d.metric), "pruned": d.base, "recovered": d.pruned,
                                                  "delta": d.delta, "ci_low": d.ci_low, "ci_high": d.ci_high,
                                                  "docs": d.docs}
    return out


def perplexity_record(base, before, after, n_boot: int = 1000) -> dict:
    """Perplexity of the base, pruned and recovered models on the same windows, the paired change of recovery,
    and the damage recovered R = (NLL_pruned - NLL_recovered) / (NLL_pruned - NLL_base) (per token)."""
    ppl = {k: perplexity(*v) for k, v in (("base", base), ("pruned", before), ("recovered", after))}
    d = paired_delta(before, after, n_boot=n_boot)
    lost = math.log(ppl["pruned"]) - math.log(ppl["base"])
    won = math.log(ppl["pruned"]) - math.log(ppl["recovered"])
    return {**ppl, "delta": d.delta, "ci_low": d.ci_low, "ci_high": d.ci_high,
            "damage_recovered": won / lost if lost > 0 else None}


def divergence_record(before: float | None, after: float | None) -> dict:
    """KL(teacher || model) per token on the evaluation windows, pruned and recovered, and the share of it recovery
    removed (1 - after / before); empty where it was not measured. Where the perplexity barely moves (a pruned
    model already close to its base there) this says whether the student still came closer to its teacher."""
    if before is None or after is None:
        return {}
    return {"kl_pruned": before, "kl_recovered": after,
            "kl_recovered_share": 1 - after / before if before > 0 else None}


def stage(session, result, progress: bool = True) -> None:
    """`pruner prune` with `recovery.enabled`: recover the pruned model in memory (in `result`) from a fresh copy
    of the base, before the run folder is written; metrics.json gets a `recovery` block."""
    spec = session.recipe.recovery
    if not spec.enabled:
        return
    if result.onloader is not None:
        raise rdata.RecoveryError("recovery needs the pruned model in memory; this run was pruned layer by "
                                  "layer (capture.onload): prune with onload: all, or recover later on a machine "
                                  "that holds it (`pruner recover RUN_DIR`)")

    def load():
        return loading.load_base(session.recipe.model, device=distributed.local_device(session.recipe.model.device))

    dense = result.plan.heads if session.recipe.surgery.mode == "mask" else None
    cache = session.checkpoints.folder / CACHE if session.checkpoints.active else None
    done = recover_models(result.model, load(), session.tokenizer, spec,
                          text=RecoveryText(data_cache=cache, teacher_cache=cache and cache / TEACHER_CACHE),
                          measures=Measures(session.evaluation, _tasks_of(session.recipe)),
                          options=Options(session.checkpoints, dense, progress), access=TeacherAccess(reload=load))
    result.model = done.model
    result.metrics["recovery"] = done.record


def _teacher(recipe, folder: Path | None):
    """(teacher, None), or -- its checkpoint `folder` read a block at a time -- (its skeleton, the onloader)."""
    if folder is None:
        return loading.load_base(recipe.model), None
    from pruner.checkpoints.lazy import lazy_model

    lazy = lazy_model(folder, recipe.model.dtype, distributed.local_device(recipe.model.device))
    return lazy.model, lazy


def _tasks_of(recipe):
    """The recipe's evaluation.tasks as a TaskSpec (None without tasks)."""
    from pruner.evaluation import tasks

    return tasks.spec_from_recipe(recipe.evaluation) if recipe.evaluation.tasks else None


def pruned_model(run: folders.Run):
    """The run's model/ as the student, loaded by the routes its reload check used; refused in one line when the
    run has none."""
    folder = run.folder / "model"
    if not (folder / "config.json").exists():
        why = (folder / "NOT_SAVED.txt").read_text().strip() if (folder / "NOT_SAVED.txt").exists() else \
            "it has no model/ folder"
        raise rdata.RecoveryError(f"{run.folder} has no pruned model to recover ({' '.join(why.split())[:200]}); "
                                  "re-run pruner prune so that it writes model/")
    return loading.load(folder).float().eval(), loading.load_tokenizer(str(folder))


def run_spec(recipe, values: dict) -> RecoverySpec:
    """A run recipe's recovery section with `values` (dotted `recovery.` keys or plain ones) on top."""
    from pruner.runs.recipe_io import validate_section

    tree = recipe.recovery.model_dump(mode="json")
    tree.update({k.removeprefix("recovery."): v for k, v in values.items()})
    return validate_section("recovery", tree)


def recover_run(run_dir, out, values: dict, overwrite: bool = False, resume_run: bool = False,
                progress: bool = True) -> dict:
    """`pruner recover RUN_DIR`: a new run folder `out` whose model/ is the recovered model; returns its metrics."""
    run = folders.load_run(Path(run_dir))
    spec = run_spec(run.recipe, values)
    check(spec, run.recipe.evaluation, Path(out).parent)
    if not (run.folder / "model" / "config.json").exists():
        pruned_model(run)  # the one-line refusal
    try:  # the teacher must be the run's base
        provenance.check_base(run.folder, run.recipe.model)
    except provenance.ProvenanceError as e:
        raise rdata.RecoveryError(str(e).split("; pass --allow-changed-base")[0] + "; recovery distils from the "
                                  "model the run was pruned from, so the teacher would not match") from None
    recipe = run.recipe.model_copy(update={"recovery": spec})
    layerwise = sequential_folder(run.recipe) if spec.teacher == "cached" else None
    if layerwise is not None:
        check_layerwise_teacher(spec)
    with folders.run_folder(Path(out), overwrite, resume_run) as tmp:
        student, tokenizer = pruned_model(run)
        teacher, onloader = _teacher(run.recipe, layerwise)
        ident = provenance.base_identity(run.recipe.model)
        fp = resume.fingerprint("recover", recipe.model_dump(mode="json"), {"run": str(run.folder)}, ident)
        checkpoints = resume.open_checkpoints(tmp, fp, None, None)
        from pruner.runs.context import evaluation_windows

        windows = evaluation_windows(run.recipe, teacher, tokenizer, True)
        dense = run.heads if run.metrics["surgery"] == "mask" else None
        done = recover_models(student, teacher, tokenizer, spec,
                              text=RecoveryText(data_cache=run.folder / CACHE, teacher_cache=tmp / TEACHER_CACHE,
                                                identity=ident),
                              measures=Measures(windows, _tasks_of(run.recipe)),
                              options=Options(checkpoints, dense, progress and distributed.is_main()),
                              access=TeacherAccess(onloader, lambda: _teacher(run.recipe, None)[0]))
        metrics = {**run.metrics, "recovery": done.record}
        if distributed.is_main():
            write_run(run, recipe, done.model, tokenizer, metrics, tmp)
    return metrics


def write_run(run: folders.Run, recipe, model, tokenizer, metrics: dict, tmp: Path) -> None:
    """The recovered run folder: model/ (reload-checked), the run's plan and compensation, the new metrics,
    recipe, report and provenance."""
    saved = folders.save_checkpoint(model, tokenizer, tmp / "model", metrics["surgery"] == "remove",
                                    folders.recipe_storage_dtype(run.recipe))
    metrics.update(model_saved=True, model_layout=saved.layout, model_dtype=saved.dtype,
                   model_bytes=sum(f.stat().st_size for f in (tmp / "model").glob("*.safetensors")))
    for name in ("plan.json", folders.COMPENSATION_FILE):
        if (run.folder / name).exists():
            shutil.copyfile(run.folder / name, tmp / name)
    (tmp / "metrics.json").write_text(report.metrics_json(metrics))
    (tmp / "recipe.yaml").write_text(recipe.to_yaml())
    (tmp / "report.md").write_text(report.run_report(metrics, (tmp / "plan.json").read_text()))
    prov_file = run.folder / provenance.FILE
    prov = json.loads(prov_file.read_text()) if prov_file.exists() else {}
    prov["recovery"] = provenance_record(run, metrics["recovery"])
    provenance.write(tmp, prov)
    shutil.rmtree(tmp / resume.STATE, ignore_errors=True)


def provenance_record(run: folders.Run, record: dict) -> dict:
    """What the recovery was made from: the teacher (the run's base), the data, the budget and the seed."""
    spec = record["spec"]
    sources = [spec["data"]] if isinstance(spec["data"], str) else spec["data"]
    rest = [s for s in sources if s != GENERATED]  # a mixture: the generated share beside the others
    source = {"generated": {"kind": "generated", "by": "teacher", "seed": spec["seed"],
                            "temperature": spec["temperature_generate"]}} if GENERATED in sources else {}
    if rest:
        source["source"] = provenance.sources_identity(rest[0] if len(rest) == 1 else rest, spec["name"],
                                                       spec["split"], spec["text_column"])
    if spec.get("weights") is not None:
        source["weights"] = dict(zip(sources, spec["weights"]))  # each source's share of the windows
    return {"from_run": str(run.folder), "teacher": provenance.base_identity(run.recipe.model)["model"],
            **source, "budget": record["budget"], "tokens": record["tokens"], "seed": record["seed"]}

