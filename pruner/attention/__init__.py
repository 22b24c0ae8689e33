"""Attention as compositional data: the two channels, sinks, the fused capture kernel and its mergeable sums."""
