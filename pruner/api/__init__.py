"""The Python API: the commands as functions, on a model you hold or name (`pruner.__all__`)."""

from __future__ import annotations

from pruner.api.analysis import Analysis, analyze
from pruner.api.evaluation import Evaluation, evaluate, export_run, load
from pruner.api.pruning import Comparison, Result, apply, compare, plan, prune
from pruner.api.recovery import Recovery, recover
from pruner.pruning.selection import Plan
from pruner.runs.recipe import Recipe, RecipeError

__all__ = ["plan", "apply", "prune", "recover", "compare", "analyze", "evaluate", "load", "export_run",
           "Plan", "Result", "Recovery", "Comparison", "Analysis", "Evaluation", "Recipe", "RecipeError"]
