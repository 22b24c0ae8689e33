"""Loading the offline models pruner ships or depends on.

all-MiniLM-L6-v2 comes without a language-model head. pruner ships a small
masked-LM readout (BERT's transform + a decoder tied to the word embeddings)
trained on the frozen encoder, so masked-token perplexity of the real
pretrained encoder can be measured before and after pruning.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import torch

from pruner import assets
from pruner.redact import redact

MINILM_READOUT_FILE = "readout.safetensors"
# Named states that load another checkpoint's weights with a different config: name -> (base, overrides).
# `minilm-causal-init`: all-MiniLM-L6-v2 run causally (BertLMHeadModel, is_decoder, LM head tied to the
# word embeddings) before any causal fine-tuning -- the starting point of `minilm-causal`, built as
# eval/train_reference.py builds it. Its LM-head transform is untrained (seeded); attention is not affected.
VARIANTS: dict[str, tuple[str, dict]] = {
    "minilm-causal-init": ("minilm", {"is_decoder": True, "tie_word_embeddings": True,
                                      "architectures": ["BertLMHeadModel"]}),
}
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


def mask_tokens(ids: torch.Tensor, attention_mask: torch.Tensor, tokenizer, prob: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: `prob` of the non-special tokens are targets (80% [MASK], 10% random, 10% kept).

    ids, attention_mask: (sample, q_pos). Returns (masked ids, labels with -100 off-target).
    """
    special = torch.zeros_like(ids, dtype=torch.bool)
    for s in tokenizer.all_special_ids:
        special |= ids == s
    candidates = (attention_mask.bool() & ~special)
    target = (torch.rand(ids.shape, generator=generator) < prob) & candidates
    labels = torch.where(target, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=generator)
    x = ids.clone()
    x[target & (roll < 0.8)] = tokenizer.mask_token_id
    rand = target & (roll >= 0.8) & (roll < 0.9)
    x[rand] = torch.randint(len(tokenizer), ids.shape, generator=generator)[rand]
    return x, labels


def resolve(name_or_path: str) -> str:
    """A shipped checkpoint name (e.g. `minilm-causal`), a local folder, or a Hub id (as given)."""
    if name_or_path in VARIANTS:
        return resolve(VARIANTS[name_or_path][0])
    if name_or_path in assets.CHECKPOINTS:
        return str(assets.checkpoint(name_or_path))
    if name_or_path == "minilm":
        return str(assets.minilm())
    local = Path(name_or_path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise FileNotFoundError(f"{local} has no config.json: not a Hugging Face checkpoint folder")
        return str(local)
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise FileNotFoundError(f"model path {name_or_path!r} does not exist")
    return name_or_path  # a Hub id: transformers fetches it (needs the network)


def shipped_name(path: str) -> str | None:
    """The shipped checkpoint name of a folder (`pruner.load("minilm-causal").name_or_path` -> "minilm-causal")."""
    if not path:
        return None
    try:
        folder = Path(path).resolve()
    except OSError:
        return None
    try:
        if folder == assets.minilm().resolve():
            return "minilm"
    except ImportError:  # all-MiniLM-L6-v2's package is an optional extra
        pass
    return next((name for name, sub in assets.CHECKPOINTS.items() if folder == (assets.MODELS / sub).resolve()), None)


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
                      f"({', '.join(['minilm', *assets.CHECKPOINTS])}) or a local folder, and the Hugging Face "
                      f"Hub did not provide it ({first}); check the id, the network and HF_TOKEN") from None


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The checkpoint's tokenizer; code it ships (`auto_map`) runs only with `trust_remote_code`."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    path = resolve(name_or_path)
    if Path(path).exists() and _is_per_layer(path):  # AutoTokenizer would ask to run the folder's model code
        from pruner import compact

        return AutoTokenizer.from_pretrained(path, config=compact.load_config(path))
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


def check_finite(model, name: str) -> None:
    """Refuse weights with NaN/inf: every statistic and score downstream would be silently NaN."""
    for pname, p in model.named_parameters():
        if p.device.type != "meta" and not torch.isfinite(p).all():
            raise ValueError(f"{name}: weight {pname} contains NaN or inf; the checkpoint is corrupt "
                             "(or was saved after a diverged training step)")


def is_causal(config) -> bool:
    """Whether a checkpoint is a causal LM (by its declared architecture or BERT's `is_decoder`)."""
    return bool(getattr(config, "is_decoder", False)) or any(
        a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))


def attends_causally(model) -> bool:
    """Whether the model's self-attention modules are causal (read off the modules themselves)."""
    return any(getattr(m, "is_causal", False) for m in model.modules() if hasattr(m, "layer_idx"))


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
        from pruner import compact

        compact.check_weights(lambda: cls.from_config(config), Path(path))
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
    modeling classes (pruner.compact / pruner.modeling), never the modeling file in the folder."""
    from pruner import compact

    model = compact.load(path, dtype=dtype, attn_implementation=attn_implementation,
                         **({"device_map": device_map} if device_map else {}))
    check_finite(model, path)
    return (model if device_map else model.to(device)).eval()


def _is_per_layer(folder: str) -> bool:
    """A pruner per-layer checkpoint (config.json has `pruner_format`): loaded by pruner.compact, no remote code."""
    import json

    return "pruner_format" in json.loads((Path(folder) / "config.json").read_text())


def auto_class(config):
    """The vanilla Auto class that loads a checkpoint with its head: causal LM, masked LM, or bare encoder."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    if is_causal(config):
        return AutoModelForCausalLM
    if is_masked_lm(config):
        return AutoModelForMaskedLM  # keeps the MLM head: masked-token perplexity
    return AutoModel


def is_masked_lm(config) -> bool:
    return any(a.endswith("ForMaskedLM") for a in (config.architectures or []))


def load_base(spec, device: str | None = None):
    """The unpruned model a recipe's `model` section names (`path`, `dtype`, `device`, `device_map`,
    `mlm_readout`, `trust_remote_code`): what `prune` calibrates and what `export` rebuilds the pruned
    model from. `device` overrides `spec.device` (each of several processes takes its own GPU)."""
    if spec.mlm_readout:
        return load_minilm_mlm(spec.mlm_readout)
    return load_model(spec.path, dtype=spec.dtype, device=device or spec.device, device_map=spec.device_map,
                      trust_remote_code=getattr(spec, "trust_remote_code", False))


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted from the first real token, so left padding never shifts them. (B, T)"""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def input_device(model) -> torch.device:
    """Where the inputs go: the embedding's device (the first device under a device_map)."""
    return model.get_input_embeddings().weight.device


@functools.lru_cache(maxsize=None)
def forward_parameters(cls) -> frozenset[str]:
    """The keyword arguments a model class's forward takes by name."""
    return frozenset(inspect.signature(cls.forward).parameters)


def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
    """One forward pass that is invariant to the padding side (explicit position ids), inputs moved to the model.

    No KV cache: pruner never generates, and a cache would keep every layer's keys and
    values alive until the pass returns (GPT-2 small, 8 x 1024 tokens: 0.6 GiB).
    """
    device = input_device(model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    if "use_cache" in forward_parameters(type(model)):
        kwargs.setdefault("use_cache", False)
    return model(input_ids=input_ids, attention_mask=attention_mask,
                 position_ids=position_ids(attention_mask), **kwargs)
