"""Recipes from YAML files, dicts, `--set key=value` overrides and Python API keywords, validated by the one
schema (`pruner.runs.recipe`) with the key path in every message."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pruner.runs.recipe import Recipe, RecipeError, error_message


def _section(tree: dict, keys: list[str], context: str = "") -> dict:
    """The section of `tree` that holds the last of `keys` (created as needed); a scalar on the way is an error."""
    node = tree
    for i, k in enumerate(keys[:-1]):
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise RecipeError(f"{context}{'.'.join(keys[:i + 1])} is not a section")
    return node


def _set(tree: dict, dotted: str, raw: str) -> None:
    """Apply one `key.path=value` override (value parsed as YAML)."""
    keys = dotted.split(".")
    node = _section(tree, keys, f"--set {dotted}: ")
    try:
        node[keys[-1]] = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:  # not YAML (e.g. `@name`): the text itself
        node[keys[-1]] = raw


def _check_key(dotted: str) -> None:
    """A dotted key must name a key the recipe schema has; the message lists the valid ones there."""
    cls: Any = Recipe
    for k in dotted.split("."):
        fields = getattr(cls, "model_fields", None)
        if fields is None or k not in fields:
            valid = ", ".join(fields) if fields else "(none: not a section)"
            raise RecipeError(f"{dotted}: no such key {k!r}; valid here: {valid}")
        cls = fields[k].annotation
        if hasattr(cls, "__args__"):  # Optional[...] etc.: the section type, if any
            cls = next((a for a in cls.__args__ if hasattr(a, "model_fields")), cls)


def _check_paths(overrides: list[str]) -> None:
    """Every `--set` override must name a key the recipe schema has."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"--set expects key=value, got {item!r}")
        try:
            _check_key(item.split("=", 1)[0])
        except RecipeError as e:
            raise RecipeError(f"--set {e}") from None


# Keyword arguments of the Python API (`pruner.plan(..., target=0.25)`) -> the recipe keys they set.
# Section names (`selection={...}`) and dotted key paths (`**{"selection.gqa": "group"}`) work too.
ALIASES = {
    "scorer": "scorer.name", "convention": "scorer.convention",
    "target": "selection.target", "budget": "selection.budget", "gqa": "selection.gqa",
    "min_heads_per_layer": "selection.min_heads_per_layer",
    "compensation": "surgery.compensation", "mode": "surgery.mode",
    "sinks": "sinks.mode", "dtype": "model.dtype", "device": "model.device", "device_map": "model.device_map",
    "threads": "threads", "seed": "seed", "trust_remote_code": "model.trust_remote_code",
    "tasks": "evaluation.tasks", "task_paths": "evaluation.task_paths", "task_limit": "evaluation.task_limit",
    "num_fewshot": "evaluation.num_fewshot",
}


def _resolve_key(key: str) -> str:
    """An API keyword, section name or dotted path -> a dotted recipe path; unknown names are refused."""
    if key in ALIASES:
        return ALIASES[key]
    if key.split(".")[0] in Recipe.model_fields:
        return key
    valid = sorted([*ALIASES, *Recipe.model_fields])
    near = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise RecipeError(f"unknown argument {key!r}{hint}; valid: {', '.join(valid)}, or a dotted recipe key "
                      "such as 'selection.gqa'")


def _apply_values(tree: dict, values: dict[str, Any]) -> None:
    """Set Python values at recipe paths (sections given as dicts are merged key by key)."""
    for key, value in values.items():
        path = _resolve_key(key)
        if isinstance(value, dict) and "." not in path:  # a whole section: merge
            for k, v in value.items():
                _apply_values(tree, {f"{path}.{k}": v})
            continue
        _check_key(path)
        keys = path.split(".")
        _section(tree, keys)[keys[-1]] = value


def build_recipe(source: "str | Path | dict | Recipe | None" = None, values: dict[str, Any] | None = None,
                 overrides: list[str] = ()) -> Recipe:
    """A validated recipe from a YAML file, a dict or a Recipe (or nothing: every default), with Python
    `values` (API keywords, sections or dotted paths) and CLI-style `key=value` overrides on top."""
    if isinstance(source, Recipe):
        source = source.model_dump(mode="json")
    tree = yaml.safe_load(yaml.safe_dump(source)) if isinstance(source, dict) else \
        {} if source is None else _read_yaml(Path(source))
    _apply_values(tree, dict(values or {}))
    return load_recipe(tree, overrides)


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        raise RecipeError(f"recipe file {path} does not exist")
    try:
        return yaml.safe_load(path.read_text())  # plain data only: never constructs Python objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        why = " ".join(str(getattr(e, "problem", None) or e).split())
        if isinstance(e, yaml.constructor.ConstructorError) and "tag" in why:
            tag = why.split("tag", 1)[1].strip(" '").replace("tag:yaml.org,2002:", "!!")
            raise RecipeError(f"recipe {path}{where}: the tag {tag} is not allowed; a recipe is plain YAML "
                              "(mappings, lists, strings, numbers, booleans)") from None
        raise RecipeError(f"recipe {path} is not valid YAML{where}: {why}") from None


def validate_section(name: str, values: dict[str, Any]):
    """One recipe section validated alone (e.g. `surgery` for `pruner.apply`), with the recipe's messages."""
    try:
        return Recipe.model_fields[name].annotation.model_validate(values)
    except ValidationError as e:
        raise RecipeError(error_message(e, prefix=name)) from None


def load_recipe(source: str | Path | dict, overrides: list[str] = ()) -> Recipe:
    """A validated recipe from a YAML path or a dict, with `key=value` overrides."""
    if isinstance(source, dict):
        tree = source
    else:
        tree = _read_yaml(Path(source))
    if not isinstance(tree, dict):
        raise RecipeError("a recipe must be a YAML mapping with at least a `model:` section")
    _check_paths(list(overrides))
    tree = yaml.safe_load(yaml.safe_dump(tree))  # deep copy
    for item in overrides:
        key, raw = item.split("=", 1)
        _set(tree, key, raw)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        raise RecipeError(error_message(e)) from None
