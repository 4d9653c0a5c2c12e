"""Pieces of the whole-process relay benchmark (``benchmarks/relay_bench.py``).

Nothing here imports the proxy: the benchmark treats every relay, karta-proxy included,
as a process it starts, feeds over loopback and measures from ``/proc``.
"""
