"""``sparsedecode models``: the built-in model aliases and what is cached."""

from __future__ import annotations

from rich.table import Table

from .display import console


def add_parsers(sub) -> None:
    models = sub.add_parser(
        "models",
        help="list built-in model aliases and what is cached",
        description="The built-in model aliases, whether each is fetched and converted in the cache "
        "(~/.cache/sparsedecode, or $SPARSEDECODE_CACHE), and where.",
        epilog="examples:\n  sparsedecode models",
    )
    models.set_defaults(handler=cmd_models)


def cmd_models(args) -> int:
    from ..models.catalog import list_models

    table = Table(title="models")
    for name in ("alias", "description", "gguf cached", "converted"):
        table.add_column(name)
    table.add_column("path", overflow="fold")  # whole, over several lines where it must: an ellipsis says no "where"
    for row in list_models():
        table.add_row(
            row["alias"],
            row.get("description", ""),
            "yes" if row.get("cached_gguf") else "no",
            "yes" if row.get("converted") else "no",
            str(row.get("path") or ""),
        )
    console.print(table)
    return 0
