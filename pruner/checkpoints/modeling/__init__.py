"""pruner's packaged per-layer modeling files: one per family, each copied next to a per-layer checkpoint.

A compact checkpoint whose layers kept different numbers of attention heads (or
whose head width a vanilla config derives from the head count) cannot be described
by a vanilla config. pruner writes it in the per-layer format: config.json holds
`pruner_format`, the base model's head counts and one count per layer, its
`model_type` is the family's with a `pruned_` prefix, and `auto_map` points the Auto
classes at `modeling_pruned_<file>.py` -- a copy of one of these files -- so
`from_pretrained(folder, trust_remote_code=True)` loads it anywhere transformers
runs. `pruner.load` loads the same checkpoint with the classes defined here, never
executing the file in the folder.

Each file subclasses the family's vanilla config and model classes and changes
only the attention projections (and the attributes its attention forward reads);
class names are the vanilla ones with a `Pruned` prefix.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

FORMAT = "per-layer-heads/1"
FORMAT_KEY = "pruner_format"
PREFIX = "Pruned"
# vanilla model_type -> packaged file (pruner/modeling/<file>.py) holding its per-layer classes
FILES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
         "gemma3_text": "llama",
         "gpt_neox": "gpt_neox", "bert": "bert", "roberta": "bert"}


class FormatError(ValueError):
    """A per-layer checkpoint pruner cannot load (unknown format version, family or class)."""


def pruned_type(model_type: str) -> str:
    """The per-layer checkpoint's model_type: `llama` -> `pruned_llama`."""
    return f"pruned_{model_type}"


def vanilla_type(model_type: str) -> str:
    """The family a per-layer model_type belongs to: `pruned_llama` -> `llama`."""
    base = model_type.removeprefix("pruned_")
    if model_type == base or base not in FILES:
        raise FormatError(f"model_type {model_type!r} is not a pruner per-layer family; known: "
                          f"{', '.join(pruned_type(t) for t in FILES)}")
    return base


def module(model_type: str) -> ModuleType:
    """The packaged modeling module of a vanilla family."""
    if model_type not in FILES:
        raise FormatError(f"no per-layer modeling file for architecture {model_type!r}; "
                          f"supported: {', '.join(sorted(FILES))}")
    return importlib.import_module(f"pruner.checkpoints.modeling.{FILES[model_type]}")


def source(model_type: str) -> Path:
    """The packaged file to copy next to the weights."""
    return Path(module(model_type).__file__)


def file_name(model_type: str) -> str:
    """What the copy is called in the checkpoint folder (the module name `auto_map` refers to)."""
    return f"modeling_pruned_{FILES[model_type]}.py"


def per_layer_class(model_type: str, vanilla_class: str):
    """`LlamaForCausalLM` -> pruner's `PrunedLlamaForCausalLM` (config classes too)."""
    mod = module(model_type)
    cls = getattr(mod, PREFIX + vanilla_class, None)
    if cls is None:
        have = sorted(n.removeprefix(PREFIX) for n in dir(mod) if n.startswith(PREFIX))
        raise FormatError(f"no per-layer class for {vanilla_class}; {mod.__name__} has {', '.join(have)}")
    return cls


def auto_map(model_type: str, model_classes: list[str], config_class: str) -> dict[str, str]:
    """config.json's `auto_map`: each Auto class a user may load the checkpoint with -> its per-layer class."""
    mod = file_name(model_type).removesuffix(".py")
    entries = {"AutoConfig": f"{mod}.{PREFIX}{config_class}"}
    for name in model_classes:
        if name.endswith(("ForCausalLM", "LMHeadModel")):
            entries["AutoModelForCausalLM"] = f"{mod}.{PREFIX}{name}"
        elif name.endswith("ForMaskedLM"):
            entries["AutoModelForMaskedLM"] = f"{mod}.{PREFIX}{name}"
        elif name.endswith("Model"):
            entries["AutoModel"] = f"{mod}.{PREFIX}{name}"
    return entries
