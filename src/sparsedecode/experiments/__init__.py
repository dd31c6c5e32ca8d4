"""Experiments built on the library: corpora, sweeps, probes, benchmarks.

This package sits on top of :mod:`sparsedecode`; the library never imports it.
"""
