"""Lean torch + Triton runtime: forward passes per architecture, kernels, expert store,
generation and the ``spark-run`` command."""
