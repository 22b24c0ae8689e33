"""Loading models: shipped names, local folders and Hub ids, pruner's own per-layer checkpoints, never remote
code unless asked.

all-MiniLM-L6-v2 comes without a language-model head. pruner ships a small
masked-LM readout (BERT's transform + a decoder tied to the word embeddings)
trained on the frozen encoder, so masked-token perplexity of the real
pretrained encoder can be measured before and after pruning.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pruner.checkpoints import modeling
from pruner.checkpoints.storage import CheckpointError, check_weights
from pruner.core import assets
from pruner.core.assets import VARIANTS, resolve
from pruner.core.redact import redact
from pruner.core.runtime import auto_class, check_finite

MINILM_READOUT_FILE = "readout.safetensors"
# tied, so not stored: decoder weight = word embeddings, decoder bias = predictions.bias
TIED_READOUT_KEYS = {"predictions.decoder.weight", "predictions.decoder.bias"}


def load_minilm_mlm(readout: Path | str | None = "shipped"):
    """`BertForMaskedLM` = all-MiniLM-L6-v2 encoder + masked-LM readout.

    `readout="shipped"` loads pruner's trained readout, a path loads another one,
    `None` leaves the readout freshly initialised (for training it).
    """
    from safetensors.torch import load_file
    from transformers import BertConfig, BertForMaskedLM
    from transformers.utils import logging as hf_logging

    path = assets.minilm()
    config = BertConfig.from_pretrained(path, tie_word_embeddings=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the readout is missing from the encoder checkpoint by design
    try:
        model = BertForMaskedLM.from_pretrained(path, config=config, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    if readout is not None:
        folder = assets.checkpoint("minilm-mlm-readout") if readout == "shipped" else Path(readout)
        head = {k: v.float() for k, v in load_file(str(folder / MINILM_READOUT_FILE)).items()}
        missing, unexpected = model.cls.load_state_dict(head, strict=False)
        if unexpected or set(missing) - TIED_READOUT_KEYS:
            raise ValueError(f"readout {folder} does not match: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    model.eval()
    return model


def _from_hub(load, name_or_path: str, what: str):
    """Call `load(path)`; a Hub id that cannot be fetched becomes one clear OSError."""
    path = resolve(name_or_path)
    try:
        return load(path)
    except OSError as e:
        if path != name_or_path or Path(path).exists():
            raise
        first = redact(str(e).strip().splitlines()[0]) if str(e).strip() else type(e).__name__
        raise OSError(f"cannot load the {what} {name_or_path!r}: it is not a shipped checkpoint "
                      f"({', '.join([*assets.PACKAGED, *assets.CHECKPOINTS])}) or a local folder or .gguf file, and the Hugging Face "
                      f"Hub did not provide it ({first}); check the id, the network and HF_TOKEN") from None


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The checkpoint's tokenizer; code it ships (`auto_map`) runs only with `trust_remote_code`."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    path = resolve(name_or_path)
    if Path(path).exists() and _is_per_layer(path):  # AutoTokenizer would ask to run the folder's model code
        return AutoTokenizer.from_pretrained(path, config=load_config(path))
    if not trust_remote_code:
        try:
            check_remote_code(name_or_path, get_tokenizer_config(path), "tokenizer_config.json")
        except OSError:
            pass  # no tokenizer config (yet): from_pretrained below says what is missing
    return _from_hub(lambda p: AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code),
                     name_or_path, "tokenizer")


class RemoteCodeError(ValueError):
    """A checkpoint that needs its own Python code, which pruner runs only when asked."""


def check_remote_code(name: str, config: dict, filename: str = "config.json") -> None:
    """Refuse a config whose `auto_map` points at code shipped with the checkpoint.

    pruner's own per-layer checkpoints (`pruner_format`) also carry an `auto_map`
    (so plain transformers can load them with trust_remote_code), but pruner loads
    them with its packaged copy of that code, never the file in the folder.
    """
    auto_map = config.get("auto_map")
    if not auto_map or config.get("pruner_format"):
        return
    refs = sorted({r for v in auto_map.values() for r in (v if isinstance(v, (list, tuple)) else [v]) if r})
    raise RemoteCodeError(f"{name}: its {filename} asks to run code shipped with the checkpoint "
                          f"({', '.join(refs)}); pruner never runs a model's own code unless asked: pass "
                          "--trust-remote-code (recipe: model.trust_remote_code: true) if you trust its author")


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu",
               attn_implementation: str = "sdpa", device_map: str | None = None, trust_remote_code: bool = False):
    """A causal LM (or BERT-style encoder) in eval mode, via vanilla `from_pretrained`.

    `device_map` (e.g. "auto") is passed to transformers/accelerate for models
    larger than one device; otherwise the model is moved to `device`. A name in
    `VARIANTS` loads its base weights with the variant's config. Code shipped with
    a checkpoint (`auto_map`) never runs unless `trust_remote_code`: its config is
    read as JSON first, and transformers is told `trust_remote_code=False` (left
    unset, it would prompt on a terminal). pruner's own per-layer checkpoints go
    to `load_pruner_format`.
    """
    from transformers import AutoConfig, PretrainedConfig
    from transformers.utils import logging as hf_logging

    path = resolve(name_or_path)
    overrides = VARIANTS[name_or_path][1] if name_or_path in VARIANTS else {}
    raw = _from_hub(lambda p: PretrainedConfig.get_config_dict(p)[0], name_or_path, "model")  # JSON only
    if raw.get("pruner_format"):
        return load_pruner_format(path, dtype=dtype, device=device, device_map=device_map,
                                  attn_implementation=attn_implementation)
    if not trust_remote_code:
        check_remote_code(name_or_path, raw)
    config = _from_hub(lambda p: AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code, **overrides),
                       name_or_path, "model")
    cls = auto_class(config)
    if Path(path).exists():  # an edited config.json (head counts) is one line here, not a reload failure
        check_weights(lambda: cls.from_config(config), Path(path))
    kw = {"device_map": device_map} if device_map else {}
    verbosity = hf_logging.get_verbosity()
    if overrides:  # a variant's new head is missing from its base checkpoint by design
        hf_logging.set_verbosity_error()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # weights a variant adds are initialised the same way every time
            model = cls.from_pretrained(path, config=config, dtype=getattr(torch, dtype),
                                        attn_implementation=attn_implementation,
                                        trust_remote_code=trust_remote_code, **kw)
    finally:
        hf_logging.set_verbosity(verbosity)
    check_finite(model, name_or_path)
    return (model if device_map else model.to(device)).eval()


def load_pruner_format(path: str, dtype: str = "float32", device: str = "cpu", device_map: str | None = None,
                       attn_implementation: str = "sdpa"):
    """One of pruner's own per-layer checkpoints (`pruner_format` in config.json), built with pruner's packaged
    modeling classes (`load`, pruner.checkpoints.modeling), never the modeling file in the folder."""
    model = load(path, dtype=dtype, attn_implementation=attn_implementation,
                         **({"device_map": device_map} if device_map else {}))
    check_finite(model, path)
    return (model if device_map else model.to(device)).eval()


def _is_per_layer(folder: str) -> bool:
    """A pruner per-layer checkpoint (config.json has `pruner_format`): loaded by `load`, no remote code."""
    import json

    return "pruner_format" in json.loads((Path(folder) / "config.json").read_text())


def load_base(spec, device: str | None = None):
    """The unpruned model a recipe's `model` section names (`path`, `dtype`, `device`, `device_map`,
    `mlm_readout`, `trust_remote_code`): what `prune` calibrates and what `export` rebuilds the pruned
    model from. `device` overrides `spec.device` (each of several processes takes its own GPU)."""
    if spec.mlm_readout:
        return load_minilm_mlm(spec.mlm_readout)
    return load_model(spec.path, dtype=spec.dtype, device=device or spec.device, device_map=spec.device_map,
                      trust_remote_code=getattr(spec, "trust_remote_code", False))


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint folder or shipped name, as a dict (no class, no remote code)."""
    from transformers import PreTrainedConfig

    d, _ = PreTrainedConfig.get_config_dict(resolve(str(path)))
    return d


def is_per_layer(config: dict) -> bool:
    return modeling.FORMAT_KEY in config


def per_layer_class(path, d: dict):
    """pruner's packaged class for a per-layer checkpoint's config.json (format version checked)."""
    version = d[modeling.FORMAT_KEY]
    if version != modeling.FORMAT:
        raise modeling.FormatError(f"{path}: per-layer format {version!r} is not one this pruner reads "
                                   f"({modeling.FORMAT}); upgrade pruner")
    kind = modeling.vanilla_type(d.get("model_type", ""))
    return modeling.per_layer_class(kind, (d.get("architectures") or [""])[0].removeprefix(modeling.PREFIX))


def load_config(path: str | Path):
    """A per-layer checkpoint's config as pruner's packaged config class (no remote code)."""
    folder = resolve(str(path))
    return per_layer_class(path, read_config(folder)).config_class.from_pretrained(folder)


def load(path: str | Path, dtype: str | None = None, device: str | None = None, **kwargs):
    """Load a checkpoint pruner wrote -- per-layer, vanilla compact or dense -- without remote code.

    Per-layer checkpoints are built with pruner's packaged classes (pruner/modeling), never
    with the modeling file in the folder; vanilla ones with transformers' Auto class.
    `kwargs` go to `from_pretrained` (e.g. `device_map`, `attn_implementation`).
    Returns the model in eval mode.
    """
    from transformers import AutoConfig

    folder = resolve(str(path))
    d = read_config(folder)
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if is_per_layer(d):
        cls = per_layer_class(path, d)
        config = cls.config_class.from_pretrained(folder)
        build = functools.partial(cls, config)
    else:
        if "auto_map" in d:
            raise CheckpointError(f"{path} needs its own modeling code (auto_map) and is not a pruner per-layer "
                                  "checkpoint; load it with transformers and trust_remote_code=True if you trust it")
        config = AutoConfig.from_pretrained(folder)
        cls = auto_class(config)
        build = functools.partial(cls.from_config, config)
    if Path(folder).exists():
        check_weights(build, Path(folder))
    model = cls.from_pretrained(folder, config=config, **kwargs)
    if device and not kwargs.get("device_map"):
        model = model.to(device)
    return model.eval()
