"""Low layer: architecture adapters, runtime helpers, data, processes, resumable checkpoints, output folders, tables."""
