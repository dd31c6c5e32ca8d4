"""What every command shares, gathered under the name the commands and tests have imported it by.

Each name is defined in the module of its idea: :mod:`.arguments` (option value types), :mod:`.parser` (the parser,
its help and the options every command spells the same), :mod:`.display` (console, progress bars, tables),
:mod:`.loading` (the model and the prompts), :mod:`.conditions` (what numbers were measured under) and
:mod:`.backend` (``--backend local | ray``). Nothing here imports torch or transformers at import time: ``--help``
and argument errors answer at once, and the library is imported by the command that runs.
"""

from __future__ import annotations

from .arguments import (
    at_least_one,
    comma_list,
    file_arg,
    float_list,
    int_list,
    path_arg,
    positive_seconds,
    selector_arg,
    selector_list,
    shard_arg,
)
from .backend import BACKENDS, add_backend_args, check_backend_args, executor
from .conditions import conditions, environment, run_settings
from .display import console, layer_table, progress_bars, run_hooks
from .loading import check_model_cache, check_prompt_source, check_whole_blocks, load, prepare, quiet_transformers
from .parser import (
    DEFAULT_MODEL,
    DRAFT_TOKENS,
    DTYPES,
    SHARED_HELP,
    HelpFormatter,
    Parser,
    add_model_args,
    add_prompt_args,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_MODEL",
    "DRAFT_TOKENS",
    "DTYPES",
    "SHARED_HELP",
    "HelpFormatter",
    "Parser",
    "add_backend_args",
    "add_model_args",
    "add_prompt_args",
    "at_least_one",
    "check_backend_args",
    "check_model_cache",
    "check_prompt_source",
    "check_whole_blocks",
    "comma_list",
    "conditions",
    "console",
    "environment",
    "executor",
    "file_arg",
    "float_list",
    "int_list",
    "layer_table",
    "load",
    "path_arg",
    "positive_seconds",
    "prepare",
    "progress_bars",
    "quiet_transformers",
    "run_hooks",
    "run_settings",
    "selector_arg",
    "selector_list",
    "shard_arg",
]
