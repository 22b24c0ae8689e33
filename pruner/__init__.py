"""pruner: sink-aware attention-head pruning for Hugging Face transformers.

The public Python API (docs/python.md); everything else is internal:

    plan, apply, prune, recover, compare, analyze, evaluate, load, export_run
    Plan, Result, Recovery, Comparison, Analysis, Evaluation, Recipe, RecipeError

Imported lazily, so `import pruner` and `pruner --help` stay fast.
"""

from pruner.core.version import __version__  # noqa: F401  (re-exported)

__all__ = ["plan", "apply", "prune", "recover", "compare", "analyze", "evaluate", "load", "export_run",
           "Plan", "Result", "Recovery", "Comparison", "Analysis", "Evaluation", "Recipe", "RecipeError"]


def __getattr__(name: str):
    if name in __all__:
        from pruner import api

        return getattr(api, name)
    raise AttributeError(f"module 'pruner' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
