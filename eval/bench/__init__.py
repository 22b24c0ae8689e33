"""Benchmarks: what a pruner stage costs in time and memory, and what pruning buys, each regenerating a docs table."""
