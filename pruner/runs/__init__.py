"""Runs: the recipe, the pipeline that drives the stages, run folders, reports, provenance and export."""
