"""`recover`: distillation from an unpruned model into a pruned one you hold (or name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pruner.api.arguments import is_texts, texts_of
from pruner.checkpoints import loading
from pruner.core import resume
from pruner.evaluation.perplexity import sliding_windows
from pruner.recovery import methods
from pruner.recovery.spec import GENERATED
from pruner.recovery.train import Options
from pruner.runs import recovery_stage
from pruner.runs.recipe_io import validate_section


@dataclass
class Recovery:
    """What `recover` did: the recovered model (the pruned one when recovery did not help) and its record."""

    model: Any = field(repr=False)
    record: dict = field(repr=False)

    def __repr__(self) -> str:
        r = self.record
        text = (f"Recovery({r['method']}, {r['tokens']:,} tokens: validation KL {r['validation_kl_pruned']:.4f} -> "
                f"{r['validation_kl_best']:.4f}, kept {r['kept']} weights")
        p = r.get("perplexity")
        if p:
            text += f"; perplexity {p['pruned']:.2f} -> {p['recovered']:.2f} (base {p['base']:.2f})"
        return text + ")"


def _model(m, trust_remote_code: bool = False):
    return loading.load(str(m)) if isinstance(m, (str, Path)) else m


def recover(student, teacher, tokenizer=None, data=GENERATED, *, eval_data=None, progress: bool = True,
            checkpoint_dir=None, **options) -> Recovery:
    """Distil `teacher` (the unpruned model) into `student` (the pruned one, in its pruned shape), in place.

    `student`, `teacher`: model objects or what `pruner.load` reads (a run's model/, an export, a shipped
    name). `data`: "generated" (text the teacher samples, seeded), a data source the recipes accept
    ("shakespeare:train", a .txt file or folder, a Hub id) or texts in memory. `options`: the recipe's
    `recovery` keys (`method="lora"`, `tokens=262144`, ...; `teacher_mode="cached"` for `recovery.teacher`). A
    dense student's all-zero output-projection head columns (its pruned heads) stay zero. `eval_data`: texts or a
    source to measure perplexity on before and after (never trained on). A teacher named (not an object you
    hold) is freed while a `cached` one's student trains. `checkpoint_dir`: checkpoints
    every `save_every` tokens; a call with the same setup continues from them. Returns a `Recovery`.
    """
    named = teacher if isinstance(teacher, (str, Path)) else None  # read again after a cached teacher's training
    student, teacher = _model(student), _model(teacher)
    if tokenizer is None:
        if not isinstance(teacher, (str, Path)) and not getattr(teacher, "name_or_path", ""):
            raise ValueError("pass the tokenizer: a model built in memory names no folder to load one from")
        tokenizer = loading.load_tokenizer(teacher.name_or_path)
    texts = texts_of(data, "text") if is_texts(data) else None
    if "teacher_mode" in options:  # `teacher` names the model here: the recipe's recovery.teacher
        options["teacher"] = options.pop("teacher_mode")
    spec = validate_section("recovery", {**options, **({} if texts else {"data": str(data)}), "enabled": True})
    windows = None
    if eval_data is not None:
        from pruner.core import data as text_data

        ev = texts_of(eval_data, "text") if is_texts(eval_data) else \
            text_data.load_texts(text_data.TextSource(str(eval_data)))
        windows = sliding_windows(tokenizer, ev, 128, max_windows=64)
    checkpoints = resume.NONE if checkpoint_dir is None else resume.open_checkpoints(
        Path(checkpoint_dir), resume.fingerprint("recover", spec.model_dump(mode="json"), {}, {}), None, None)
    done = recovery_stage.recover_models(
        student.float(), teacher, tokenizer, spec, text=recovery_stage.RecoveryText(texts),
        measures=recovery_stage.Measures(windows), options=Options(checkpoints, methods.zero_heads(student), progress),
        access=recovery_stage.TeacherAccess(reload=None if named is None else lambda: _model(named)))
    return Recovery(done.model, done.record)
