"""Evaluation: perplexity with paired CIs, downstream tasks, and what a compact model buys (bench, ideal)."""
