"""Checkpoints: loading models, writing pruned ones in the form that holds them, and proving they reload."""
