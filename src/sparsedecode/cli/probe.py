"""``sparsedecode probe mass | retrieval``: where attention mass goes, and whether a passkey is still found."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from ..errors import SparseDecodeError
from .arguments import float_list, int_list, path_arg, selector_arg
from .conditions import conditions, run_settings
from .display import console, layer_table, plain, progress_bars
from .loading import check_whole_blocks, load, prepare
from .outputs import atomic_path, check_output_folder, check_replaced_alike, inputs_of, write_json
from .parser import Parser, add_dense_layers_arg, add_model_args, add_prompt_args, layer_budget


def add_parsers(sub) -> None:
    probe = sub.add_parser(
        "probe",
        help="probes: mass (attention-mass decomposition), retrieval (passkey)",
        epilog="examples:\n"
        "  sparsedecode probe mass --context 2048 --support 97,193\n"
        "  sparsedecode probe retrieval --context 1024 --depths 0,0.5,1 --trials 2 --support 97,193",
    )
    probes = probe.add_subparsers(dest="probe", required=True, parser_class=Parser)
    mass = probes.add_parser(
        "mass",
        help="attention-mass decomposition per layer and head for one prompt",
        description="Decode one prompt sparsely, recompute dense attention at every step, and split the attention "
        "mass into anchor / window / selected blocks / omitted, per layer; a layer x head heat map of the omitted "
        "mass (PNG) and the arrays go to OUT.",
        epilog="examples:\n"
        "  sparsedecode probe mass --context 2048 --support 97,193\n"
        "  sparsedecode probe mass --context 1024 --support 193 --selector quest --out runs/mass-quest",
    )
    add_model_args(mass)
    add_prompt_args(mass, tokens=16)
    mass.add_argument(
        "--out", type=path_arg, default=Path("runs/probe-mass"), help="folder for the PNG heat map, JSON and arrays"
    )
    mass.set_defaults(handler=cmd_probe_mass)

    retrieval = probes.add_parser(
        "retrieval",
        help="passkey retrieval, dense vs sparse, with captured mass",
        description="Plant a passkey at each depth of a haystack, prefill densely, feed the question token by token "
        "and answer greedily, dense and at each support; the audit records the captured attention mass per trial.",
        epilog="examples:\n"
        "  sparsedecode probe retrieval --context 1024 --depths 0,0.5,1 --trials 2 --support 97,193\n"
        "  sparsedecode probe retrieval --context 2048 --haystack python-docs --out runs/retrieval-prose",
    )
    add_model_args(retrieval)
    retrieval.add_argument(
        "--context", type=int_list, default=[2048], help="prompt lengths in tokens, question included, comma-separated"
    )
    retrieval.add_argument(
        "--depths",
        type=float_list,
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="passkey depths, comma-separated: 0 = right after the instructions, 1 = right before the question",
    )
    retrieval.add_argument("--trials", type=int, default=3, help="passkeys per (context, depth)")
    retrieval.add_argument("--support", type=int_list, default=[97, 193])
    retrieval.add_argument("--window", type=int, default=64)
    retrieval.add_argument("--block-size", type=int, default=16)
    retrieval.add_argument("--reuse", type=int, default=1)
    retrieval.add_argument("--selector", type=selector_arg, default="mean-pooled")
    add_dense_layers_arg(retrieval)
    retrieval.add_argument("--haystack", default="filler", help="filler (repeated sentences), or a corpus name/path")
    retrieval.add_argument("--digits", type=int, default=5, help="passkey length, in digits")
    retrieval.add_argument("--answer-tokens", type=int, default=8)
    retrieval.add_argument("--seed", type=int, default=0)
    retrieval.add_argument(
        "--out", type=path_arg, default=Path("runs/probe-retrieval"), help="folder for retrieval.json"
    )
    retrieval.set_defaults(handler=cmd_probe_retrieval)


MAPS = ("mass-c*-s*.png", "mass-c*-s*.npz")
"""A mass probe's heat maps and audits, which its ``mass.json`` lists."""


def _check_no_unlisted_maps(folder: Path) -> None:
    """Maps without the ``mass.json`` that lists them (a run killed before writing it, a removed ``mass.json``)
    would sit beside this run's as if they were its own: refused."""
    if folder.is_dir() and not (folder / "mass.json").exists():
        orphans = sorted(path.name for pattern in MAPS for path in folder.glob(pattern))
        if orphans:
            raise SparseDecodeError(
                f"--out {folder} holds {orphans[0]} (and {len(orphans) - 1} more) but no mass.json listing them: "
                "maps of a run that did not finish; remove them, or give another folder"
            )


def cmd_probe_mass(args) -> int:
    stems = [f"mass-c{c}-s{s}" for c in args.context for s in args.support]
    written = ("mass.json", *(f"{stem}{suffix}" for stem in stems for suffix in (".png", ".npz")))
    check_output_folder(args.out, inputs=inputs_of(args), files=written, results="mass.json")
    check_replaced_alike(args.out, "mass.json", run_settings(args, "probe mass", machine=False))  # no stale maps
    _check_no_unlisted_maps(args.out)
    replacing = (args.out / "mass.json").is_file()  # a rerun of the same settings: the same maps, rewritten
    made: list[Path] = []
    try:
        return _probe_mass(args, made)
    except BaseException:  # an error or an interrupt: no maps left without the mass.json listing them
        for path in made if not replacing else ():  # (a rerun's replace the maps the earlier mass.json lists)
            path.unlink(missing_ok=True)
        raise


def _probe_mass(args, made: list[Path]) -> int:
    """:func:`cmd_probe_mass`'s work once the folder is checked: every probe first, then the maps (each added to
    ``made`` as it is written) and ``mass.json``, so that an interrupted probe leaves the folder as it was."""
    configs, model, _, prompts = prepare(args, audit=True)
    from ..decoding.loop import prefill
    from ..experiments.probes import mass_probe

    console.print(conditions(args))
    done = []
    for context, ids in prompts.items():
        with progress_bars(piped_lines=True) as progress:
            cache, logits = prefill(model, ids, progress=progress)
            first = int(logits.argmax())
            probes = [
                mass_probe(model, ids, cfg, tokens=args.tokens, progress=progress, cache=cache, first=first)
                for cfg in configs
            ]
        for probe in probes:
            support = probe.settings["support"]
            if not probe.summary.get("audited_steps"):
                console.print(
                    f"context {context}, S={support}: nothing to audit: no layer decoded sparsely (each layer's "
                    "support covers the context, or the layer is in --dense-layers)"
                )
                continue
            console.print(layer_table(f"attention mass, context {context}, S={support}", probe.summary))
            done.append((context, probe))
    rows = [_write_maps(args, context, probe, made) for context, probe in done]
    write_json(args.out / "mass.json", {"settings": run_settings(args, "probe mass"), "results": rows})
    return 0


def _write_maps(args, context: int, probe, made: list[Path]) -> dict:
    """One probe's heat map and audit arrays written; its row of ``mass.json``."""
    import numpy as np

    from ..protocol.diagnostics import save_audit
    from ..reports.plots import heatmap

    support = probe.settings["support"]
    omitted = probe.per_head("omitted_mass")
    stem = f"mass-c{context}-s{support}"
    png = args.out / f"{stem}.png"
    made += [png, args.out / f"{stem}.npz"]
    with atomic_path(png) as tmp:
        heatmap(
            omitted,
            tmp,
            title=f"{args.model}: omitted attention mass ε, context {context}, S={support}\n"
            f"mean over {probe.summary['audited_steps']} sparse decode steps",
            xlabel="query head",
            ylabel="layer",
            yticks=[str(layer) for layer in probe.arrays["layers"].tolist()],  # the audited ones (not dense layers)
            colorbar="omitted mass ε",
            vmax=max(float(np.nanmax(omitted)), 1e-6),  # NaN: a head a layer lacks (fewer query heads than another)
        )
    save_audit(args.out / f"{stem}.npz", probe.arrays)
    console.print(f"wrote {plain(png)}")
    return {"context": context, "settings": probe.settings, "summary": probe.summary, "png": png.name,
            "seconds": probe.seconds}  # fmt: skip


def _depth(depth: float) -> str:
    """A depth as ``--depths`` takes it back: short (``0.5``, ``1``) where that is the same number, else every digit
    (``f"{d:g}"`` keeps six: 0.1234567 would come back as another depth)."""
    short = f"{depth:g}"
    return short if float(short) == depth else repr(float(depth))


def _retrieval_command(spec, out: Path) -> str:
    """The ``sparsedecode probe retrieval`` command line that reproduces ``spec`` into ``out``."""
    from ..experiments.specs import RetrievalSpec
    from ..reports.tables import changed_flags, shell_word

    default = RetrievalSpec(model=spec.model)
    parts = [
        f"sparsedecode probe retrieval --model {shell_word(spec.model)} --dtype {spec.dtype} "
        f"--context {','.join(map(str, spec.contexts))} --depths {','.join(map(_depth, spec.depths))} "
        f"--trials {spec.trials} --support {','.join(map(str, spec.supports))} --haystack {shell_word(spec.haystack)}"
    ]
    parts += changed_flags(
        spec, default, ("window", "block_size", "reuse", "selector", "digits", "answer_tokens", "seed")
    )
    parts.append(f"--out {shell_word(out)}")
    return " ".join(parts)


def _check_retrieval_args(args):
    """The probe's spec, checked from the arguments alone (the spec's own checks and the command line's
    whole-blocks rule), before torch is imported."""
    from ..experiments.specs import RetrievalSpec

    spec = RetrievalSpec(
        model=args.model,
        dtype=args.dtype,
        contexts=tuple(args.context),
        depths=tuple(args.depths),
        trials=args.trials,
        supports=tuple(args.support),
        window=args.window,
        block_size=args.block_size,
        reuse=args.reuse,
        selector=args.selector,
        haystack=args.haystack,
        digits=args.digits,
        answer_tokens=args.answer_tokens,
        seed=args.seed,
        **layer_budget(args),
    )
    check_whole_blocks(spec.configs())
    return spec


def cmd_probe_retrieval(args) -> int:
    spec = _check_retrieval_args(args)
    from ..experiments.environment import environment as measured_environment
    from ..experiments.retrieval import accuracy, run_retrieval
    from ..reports.tables import shell_word

    check_output_folder(args.out, inputs=inputs_of(args), files=("retrieval.json",), results="retrieval.json")
    check_replaced_alike(args.out, "retrieval.json", spec.to_dict(), key="spec")
    loaded = load(args)
    console.print(
        f"[bold]{plain(args.model)}[/] {args.dtype}; passkey retrieval, haystack {plain(args.haystack)}; "
        f"contexts {args.context}; depths {args.depths}; {args.trials} trials; supports {args.support}"
    )

    def show(trial: dict) -> None:
        mode = "dense" if trial["mode"] == "dense" else f"S={trial['support']}"
        mass = trial["captured_mass_ratio_mean"]
        console.print(
            f"context {trial['context']}, depth {trial['depth']:g}, trial {trial['trial']}, {mode}: "
            + ("[green]found[/]" if trial["correct"] else "[red]missed[/]")
            + f" {trial['passkey']} in {plain(repr(trial['answer']))}"
            + (f"; captured mass {mass:.3f}, needle read {trial['needle_read_mean']:.2f}" if mass is not None else "")
        )

    with progress_bars(speed_estimate_period=3600.0, piped_lines=True) as progress:
        trials = run_retrieval(spec, loaded=loaded, progress=progress, on_trial=show)
    data = {
        "spec": spec.to_dict(),
        "command": _retrieval_command(spec, args.out),
        "environment": measured_environment(loaded[0]),
        "trials": trials,
    }
    write_json(args.out / "retrieval.json", data)
    table = Table(title="passkey exact-match accuracy")
    for name in ("mode", "context", "depth", "correct"):
        table.add_column(name, justify="right")
    for row in accuracy(trials):
        table.add_row(row["mode"], str(row["context"]), f"{row['depth']:g}", f"{row['correct']}/{row['trials']}")
    console.print(table)
    console.print(
        f"wrote {plain(args.out / 'retrieval.json')}; `sparsedecode report {plain(shell_word(args.out))}` renders it"
    )
    return 0
