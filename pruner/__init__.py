"""pruner: sink-aware attention-head pruning for Hugging Face transformers."""

__version__ = "0.1.0"
