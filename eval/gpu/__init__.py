"""Checks for a CUDA machine: the GPU gives the CPU's answers, and what calibration and recovery cost there."""
