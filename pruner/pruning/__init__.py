"""Pruning: calibration, head scores, selection, surgery (mask / remove) and compensation (mean / refit)."""
