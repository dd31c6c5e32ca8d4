"""The built-in selectors, one module per method: the project's own (:mod:`.mean_pooled`), the references
(:mod:`.oracle`, :mod:`.random_blocks`, :mod:`.streaming`) and methods from the literature written on the public
protocol (:mod:`.quest`, :mod:`.sparq`, :mod:`.twilight`, :mod:`.h2o`, :mod:`.sink_streaming`) and this project's
adaptive budget over blocks (:mod:`.top_p`, ``block-top-p``). The registry registers
:data:`BUILTINS` under their names the first time a selector is looked up."""

from .h2o import H2O
from .mean_pooled import MeanPooled
from .oracle import OracleBlocks, OracleTokens
from .quest import Quest
from .random_blocks import RandomBlocks
from .sink_streaming import SinkStreaming
from .sparq import SparQ
from .streaming import Streaming
from .top_p import TopP
from .twilight import Twilight

BUILTINS = (
    TopP,
    H2O,
    MeanPooled,
    OracleBlocks,
    OracleTokens,
    Quest,
    RandomBlocks,
    SinkStreaming,
    SparQ,
    Streaming,
    Twilight,
)
"""Every built-in selector class, in the order ``selector_names()`` lists them."""
