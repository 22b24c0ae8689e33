"""Arguments -> one validated recipe plus what the caller holds in memory (model, tokenizer, texts).

    import pruner
    plan = pruner.plan(model, tokenizer, texts, scorer="sink-aware", target=0.25)   # nothing changed yet
    pruner.apply(model, plan, compensation="refit", mode="remove")                   # in place
    result = pruner.prune(model, tokenizer, texts, target=0.25)                      # plan + apply + evaluate

Every function takes the model as an object (built in memory, fine-tuned,
wrapped: anything with a supported architecture) or as what a recipe's
`model.path` names (a shipped name, a local folder, a Hub id). Options are named
as the recipes name them: a recipe file, dict or `Recipe` (`recipe=`), API
keywords (`target=0.25`, `compensation="mean"`: `pruner.runs.recipe_io.ALIASES`), whole
sections (`selection={"budget": "layer"}`) or dotted keys
(`**{"selection.gqa": "group"}`), all validated by the one recipe model with the
command line's one-line errors. The command line is a thin shell over these
functions, so the two cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pruner.checkpoints import loading
from pruner.core import arch, assets, distributed, resume
from pruner.runs import context, provenance
from pruner.runs.recipe import Recipe
from pruner.runs.recipe_io import build_recipe

IN_MEMORY = "(in memory)"


def is_texts(data) -> bool:
    return isinstance(data, (list, tuple)) or hasattr(data, "column_names")  # texts, or a datasets.Dataset


def texts_of(data, column: str) -> list[str]:
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
class Call:
    """One API call resolved: the validated recipe and the objects and texts given in memory."""

    recipe: Recipe
    model: Any = None
    tokenizer: Any = None
    calibration_texts: list[str] | None = None
    evaluation_texts: list[str] | None = None

    def session(self, progress: bool, evaluation: bool = True,
                checkpoints: resume.Checkpoints = resume.NONE, whole_model: bool = True) -> context.Session:
        given = context.Given(self.model, self.tokenizer, self.calibration_texts, self.evaluation_texts)
        return context.prepare(self.recipe, progress, given=given, evaluation=evaluation, checkpoints=checkpoints,
                               whole_model=whole_model)

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


def resolve_call(model, tokenizer, data, recipe, overrides: dict, eval_data=None,
             cli_overrides: list[str] = ()) -> Call:
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
    if held is not None and not names_model(tree):
        values.setdefault("model.path", model_name(held))
    r = build_recipe(tree, values, cli_overrides)
    tok = tokenizer
    if held is not None and tok is None:
        if r.model.path == IN_MEMORY:
            raise ValueError("pass the tokenizer: a model built in memory names no folder to load one from")
        tok = loading.load_tokenizer(r.model.path, r.model.trust_remote_code)
    cal = texts_of(data, r.calibration.text_column) if is_texts(data) else None
    ev = texts_of(eval_data, r.evaluation.text_column) if is_texts(eval_data) else None
    return Call(r, held, tok, cal, ev)


def model_name(model) -> str:
    """What a model object is called in recipes and reports: its shipped name, its folder or Hub id, or
    "(in memory)" when it was built in memory."""
    path = getattr(model, "name_or_path", "") or ""
    return assets.shipped_name(path) or path or IN_MEMORY


def names_model(tree) -> bool:
    if isinstance(tree, Recipe):
        return True
    if isinstance(tree, dict):
        return bool((tree.get("model") or {}).get("path"))
    return True  # a recipe file: it must name its model (validated)


def check_choices(what: str, given, valid: tuple[str, ...]) -> None:
    bad = [c for c in given if c not in valid]
    if bad:
        raise ValueError(f"unknown {what} {bad}; valid: {', '.join(valid)}")


def sparsity(value) -> float:
    """A sparsity as the recipe's selection.target: a fraction in (0, 1) or a whole head count."""
    from pruner.runs.recipe import SelectionSpec

    try:
        return SelectionSpec(target=value).target
    except Exception:  # noqa: BLE001 - pydantic/ValueError: one message for every bad value
        raise ValueError(f"sparsity {value!r} is neither a fraction in (0, 1) nor a whole head count") from None


def model_and_tokenizer(model, tokenizer, trust_remote_code: bool = False):
    """(model object, tokenizer, name) from an object or a name/path."""
    if isinstance(model, (str, Path)):
        loaded = loading.load_model(str(model), trust_remote_code=trust_remote_code)
        arch.adapter_for(loaded)  # e.g. a per-layer checkpoint: no single head count to measure
        return loaded, tokenizer or loading.load_tokenizer(str(model), trust_remote_code), str(model)
    arch.adapter_for(model)
    if tokenizer is None:
        raise ValueError("pass the tokenizer with a model object")
    return model, tokenizer, model_name(model)


def same_tokenizer(a, b, names: tuple[str, str]) -> None:
    if a.get_vocab() != b.get_vocab() or a.all_special_ids != b.all_special_ids:
        raise ValueError(f"--compare-to needs the same tokenizer (the same token rows): {names[0]} and "
                         f"{names[1]} tokenise differently")
