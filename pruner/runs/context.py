"""A session: what every stage of a run shares -- the model (or, layer by layer, its blocks on disk), the tokenizer,
the calibration samples and the evaluation windows -- built once from a validated recipe and what the caller
holds in memory."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pruner.attention.capture import resolve_auto_sinks
from pruner.attention.sinks import SinkSpec, check_content, default_spec
from pruner.checkpoints import loading
from pruner.checkpoints.lazy import lazy_model
from pruner.core import arch, assets, data, distributed, mixture, resume, runtime
from pruner.evaluation import downstream, tasks
from pruner.evaluation.perplexity import EvalWindows, masked_lines, sliding_windows
from pruner.runs import calibration_memory, resources
from pruner.runs.recipe import Recipe


@dataclass
class Session:
    """What every stage shares: the model, tokenizer and samples, built once.

    `evaluation` (the windows perplexity is measured on) is built on first use, so
    planning alone never reads the evaluation text.
    """

    recipe: Recipe
    model: object
    tokenizer: object
    causal: bool
    sinks: SinkSpec
    calibration: data.TokenBatch
    evaluation_texts: list[str] | None = None  # given in memory; otherwise read from recipe.evaluation
    _evaluation: EvalWindows | None = field(default=None, repr=False)
    _downstream: downstream.Downstream | None = field(default=None, repr=False)
    checkpoints: resume.Checkpoints = field(default=resume.NONE, repr=False)  # a resumable run's saved stages
    onloader: object | None = field(default=None, repr=False)  # capture.onload sequential: the blocks stay on disk
    heldout: data.TokenBatch | None = None  # calibration.holdout's samples, never in the sums (auto scores on them)
    unset: tuple[str, ...] = ()  # keys the recipe left unset, resolved in `recipe` (`prepare`)

    @property
    def evaluation(self) -> EvalWindows:
        if self._evaluation is None:
            self._evaluation = evaluation_windows(self.recipe, self.model, self.tokenizer, self.causal,
                                                  self.evaluation_texts)
        return self._evaluation

    @property
    def downstream(self) -> downstream.Downstream | None:
        """The recipe's evaluation.tasks, loaded once (None without tasks)."""
        ev = self.recipe.evaluation
        if self._downstream is None and ev.tasks:
            self._downstream = downstream.Downstream(self.model, self.tokenizer, tasks.spec_from_recipe(ev), self.causal,
                                                n_boot=max(ev.bootstrap, 1))
        return self._downstream


def _source(spec, path: str | None = None) -> data.TextSource:
    return data.TextSource(path or spec.data, split=spec.split, text_column=spec.text_column, name=spec.name)


def calibration_samples(recipe: Recipe, tokenizer, texts: list[str] | None = None):
    """(calibration samples, held-back samples or None): the recipe's source or mixture (`pruner.core.mixture`),
    or `texts` given in memory as its one source."""
    cal = recipe.calibration
    sources = cal.sources() if texts is None else ["(in memory)"]
    corpora = [texts] if texts is not None else [data.load_texts(_source(cal, s)) for s in sources]
    draw = mixture.Draw(num_samples=cal.num_samples, seed=cal.seed, holdout=cal.held_back(recipe.auto()))
    return mixture.mixed_samples(tokenizer, corpora, cal.unit, cal.length, weights=cal.weights if texts is None
                                 else None, bos=cal.bos, draw=draw, names=sources)


def evaluation_windows(recipe: Recipe, model, tokenizer, causal: bool, texts: list[str] | None = None) -> EvalWindows:
    """Decoders: strided perplexity windows; encoders: lines with a fixed masking (needs an MLM head)."""
    ev = recipe.evaluation
    texts = texts if texts is not None else data.load_texts(_source(ev))
    if causal:
        return sliding_windows(tokenizer, texts, ev.length, ev.stride, bos=ev.bos, max_windows=ev.num_samples)
    if not hasattr(model, "cls"):
        raise ValueError(f"{recipe.model.path}: masked-token perplexity needs a masked-LM head "
                         "(set model.mlm_readout: shipped for all-MiniLM-L6-v2)")
    return masked_lines(tokenizer, texts, ev.length, num_samples=ev.num_samples, seed=ev.seed)


@dataclass(frozen=True)
class Given:
    """What a caller of `prepare` holds in memory instead of what the recipe names (None: the recipe's)."""

    model: object = None
    tokenizer: object = None
    calibration_texts: list[str] | None = None
    evaluation_texts: list[str] | None = None


def prepare(recipe: Recipe, progress: bool = True, *, given: Given = Given(), evaluation: bool = True,
            checkpoints: resume.Checkpoints = resume.NONE, whole_model: bool = True) -> Session:
    """Load (or take) the model and tokenizer, sample the calibration text, resolve the sinks.

    `given.model`/`given.tokenizer` default to what `recipe.model` names; texts default to the
    recipe's data sources. With `evaluation`, the evaluation windows are built now,
    so unusable evaluation text fails before any calibration compute. `checkpoints`:
    where a resumable run keeps its stages (`pruner.core.resume`). `whole_model`: whether a later stage
    needs the whole model in memory (downstream tasks); if so, a layer-by-layer run that could not hold it
    is refused now. An unset `surgery.compensation` is resolved here (`SurgerySpec.resolved`), named in
    `Session.unset`.
    """
    model, tokenizer = given.model, given.tokenizer
    calibration_texts, evaluation_texts = given.calibration_texts, given.evaluation_texts
    unset = ("surgery.compensation",) if recipe.surgery.compensation is None else ()
    recipe = recipe.model_copy(update={"surgery": recipe.surgery.resolved()})  # every stage reads what the run uses
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    m = recipe.model
    onloader = None
    if model is None:
        model, onloader = _load(recipe)
    arch.adapter_for(model)  # unsupported architecture: fail before any compute
    tok = tokenizer if tokenizer is not None else loading.load_tokenizer(m.path, m.trust_remote_code)
    causal = runtime.attends_causally(model)
    cal = recipe.calibration
    batch, heldout = calibration_samples(recipe, tok, calibration_texts)
    s = recipe.sinks
    spec = default_spec(causal) if s.mode is None else SinkSpec(s.mode, tuple(s.ids), tuple(s.positions), s.eps)
    session = Session(recipe, model, tok, causal, spec, batch, evaluation_texts, checkpoints=checkpoints,
                      onloader=onloader, heldout=heldout, unset=unset)
    if evaluation and whole_model and onloader is not None:  # needed later and cannot fit: refused before compute
        _check_whole_model_fits(m, onloader.folder)
    if evaluation:
        session.evaluation  # noqa: B018 - built now: bad evaluation text fails before calibration
        session.downstream  # noqa: B018 - and unknown tasks, a missing extra or an unreachable dataset
    if spec.mode == "auto":
        session.sinks = resolve_auto_sinks(model, batch, tok, eps=spec.eps, batch_size=cal.batch_size,
                                           checkpoints=checkpoints)
    check_content(batch.input_ids, batch.attention_mask, session.sinks, tok)
    return session


def sequential_folder(recipe: Recipe) -> Path | None:
    """The checkpoint folder a layer-by-layer pass reads the blocks from, when the recipe's `capture.onload`
    resolves to sequential (None: the model is loaded whole)."""
    m = recipe.model
    device = distributed.local_device(m.device)
    folder = Path(assets.resolve(m.path)) if not m.mlm_readout and not m.device_map else None
    folder = folder if folder is not None and folder.exists() else None
    if recipe.capture.onload == "sequential" and folder is None:
        raise ValueError(f"capture.onload: sequential reads the blocks from a local checkpoint folder; {m.path} is not "
                         "one (download it first, e.g. `hf download ID --local-dir DIR`, and name the folder)")
    return folder if resources.onload_mode(recipe.capture.onload, folder, m.dtype, device) == "sequential" else None


def _load(recipe: Recipe):
    """The recipe's model, and the onloader of its blocks when `capture.onload` resolves to sequential: then the
    model is built without its blocks' weights, which stay in the checkpoint until calibration reads them."""
    m = recipe.model
    device = distributed.local_device(m.device)
    folder = sequential_folder(recipe)
    if folder is not None:
        lazy = lazy_model(folder, m.dtype, device)
        lazy.read_ahead = recipe.capture.read_ahead
        return lazy.model, lazy
    return loading.load_base(m, device=device), None


def resident(session: Session) -> None:
    """The whole model in memory for the stages that run it whole (downstream tasks; latency and bench), after a
    layer-by-layer calibration read its blocks one at a time; refused in one line when it cannot fit."""
    if session.onloader is None:
        return
    m = session.recipe.model
    _check_whole_model_fits(m, session.onloader.folder)
    session.model, session.onloader = loading.load_base(m, device=distributed.local_device(m.device)), None


def _check_whole_model_fits(m, folder: Path) -> None:
    """Refuse in one line when the whole model will not fit where the later stages need it resident."""
    device = distributed.local_device(m.device)
    need = resources.checkpoint_model_bytes(folder, m.dtype)
    free = resources.available_memory(device)
    if need is not None and free is not None and need > free:
        raise resources.ResourceError(
            f"evaluation.tasks run the whole model ({resources.gib(need)} in {m.dtype}), and only "
            f"{resources.gib(free)} is free on {device}: without tasks, prune and compare run layer by layer "
            "(perplexity, compensation and the written model/ one block at a time); or use a machine with more "
            "memory")


def check_layerwise(session: Session, sizes: resources.Sizes, systems: bool) -> None:
    """Before a layer-by-layer calibration: its memory check (`pruner.runs.calibration_memory.check_sequential`,
    unless capture.memory_check is off) and where its hidden states go (capture.hidden)."""
    cap = session.recipe.capture
    if cap.memory_check:
        plan = calibration_memory.check_sequential(session.model, sizes, len(session.calibration),
                                                   session.onloader.device, systems, cap.hidden, cap.read_ahead)
        if plan.spill:
            spill_hidden(session, sizes.gradient, cap.hidden == "auto")
    elif cap.hidden == "disk":
        spill_hidden(session, sizes.gradient)


def spill_hidden(session: Session, gradient: bool, chosen: bool = False) -> None:
    """Every layer-by-layer pass from here on keeps its hidden states in files (capture.hidden: disk, or auto
    where memory cannot hold them) under capture.spill_dir (default: the system's temporary folder), refused
    in one line when that folder's disk has no room for them; said in a warning when auto chose it."""
    import tempfile

    r = session.recipe
    folder = Path(r.capture.spill_dir) if r.capture.spill_dir is not None else Path(tempfile.gettempdir())
    slots = arch.geometry(session.model).n_layers + 2 if gradient else 2  # every block's inputs + gradients
    need = calibration_memory.hidden_bytes(session.model, slots * session.calibration.input_ids.numel())
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"capture.spill_dir: cannot make the folder {folder} for capture.hidden's files "
                         f"({e.strerror}); name a folder, or one that can be created, on a disk with room") from None
    if need > resources.free_disk(folder):
        raise resources.ResourceError(
            f"not enough disk space in {folder} for capture.hidden: disk: the hidden states need about "
            f"{resources.gib(need)} and {resources.gib(resources.free_disk(folder))} is free; set capture.spill_dir "
            "to a folder with room")
    if chosen:
        warnings.warn(f"the calibration's hidden states do not fit in memory: they go to files in {folder} "
                      f"(capture.hidden: auto; about {resources.gib(need)}, removed after each pass)", stacklevel=2)
    session.onloader.spill = folder
