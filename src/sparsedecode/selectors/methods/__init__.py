"""Imports every built-in selector module, each of which registers its selectors."""

from . import h2o, mean_pooled, oracle, quest, random_blocks, sink_streaming, sparq, streaming, top_p  # noqa: F401  # noqa: F401  (published methods, written on the public protocol)
