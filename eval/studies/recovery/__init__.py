"""The recovery study: shipped decoders pruned, recovered by `pruner recover`, measured on held-out text."""
