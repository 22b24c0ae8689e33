"""The Python API: prune, compare and analyze a model you already hold, from a notebook or a script.

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

from pruner.api.analysis import Analysis, analyze
from pruner.api.evaluation import Evaluation, evaluate, export_run, load
from pruner.api.pruning import Comparison, Result, apply, compare, plan, prune
from pruner.pruning.selection import Plan
from pruner.runs.recipe import Recipe, RecipeError

__all__ = ["plan", "apply", "prune", "compare", "analyze", "evaluate", "load", "export_run",
           "Plan", "Result", "Comparison", "Analysis", "Evaluation", "Recipe", "RecipeError"]
