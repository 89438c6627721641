"""`python -m coopstudy <command>`: the one parser of the project.

The study's steps come first, in protocol order, then `study`, which runs
them all (`coopstudy.study`). Each step module in `coopstudy.steps` defines
`HELP` (its one-line summary), `DESCRIPTION` (what it reads and writes),
optionally `add_arguments(parser)` and `check_arguments(cfg, args)` (what it
refuses in its arguments before any work, which `--dry-run` refuses too), and
`run(cfg, args) -> int | None`; the parser gives every step `--preset`,
`--set` and `--dry-run` and hands it the loaded config.

Then the tools: `bench` (benchmarks, which load a preset like a step),
`dev-split` (families and learning rate measured on a development split),
`remote` (the tracking server: check it, deliver what waited). A training
process is no command: `train`, `probe` and `bench arms` start
`python -m coopstudy.run.worker`, whose entry is its own. A tool module
defines `HELP` and `add_arguments(parser)`; one that loads a preset
(bench, dev-split: it calls `add_config_arguments`) is run as a step is, through
`run(cfg, args)` and an optional `check_arguments(cfg, args)` that `--dry-run`
calls too; remote through `main(args) -> int`.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import re
import shlex
import signal
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from coopstudy import config as config_mod
from coopstudy import errors, machine
from coopstudy import steps as steps_pkg
from coopstudy import workspace
from coopstudy.errors import UserError
from coopstudy.record import schema

STUDY_STAGES = steps_pkg.ORDER
"""The steps a study runs, in protocol order (`--help` lists them so)."""
STEPS = (*STUDY_STAGES, schema.STAGE_STUDY)
"""Every step command: the study's, then `study`, which runs them all."""
TOOLS = {"bench": "coopstudy.bench", "dev-split": "coopstudy.devsplit", "remote": "coopstudy.record.remote"}
SUBCOMMAND_DESTS = ("bench", "command")
"""Where `bench` and `remote` keep their subcommand: a refusal names it as the parser does."""
DEFAULT_PRESET = "smollm2-135m-cpu"


def where_things_go() -> str:
    """The epilog of every help: where the study's files and runs go. (The
    store module is imported here, not with this one: it reads `mlflow run`'s
    variables once, when imported, and tests/warm_cli.py imports this module
    in a server before any command's environment is set.)"""
    from coopstudy.record.store import REMOTE_FILE

    return textwrap.fill(
        "where things go: the study's files (<home>: prepared inputs, seeds, checkpoints, the ledger, "
        f"reports) in ${workspace.HOME_VARIABLE}, else .coopstudy/ in the project; every run in the MLflow "
        f"store of $MLFLOW_TRACKING_URI, else the server the project's {REMOTE_FILE} names, "
        "else mlflow.db in the project (README: A shared tracking server)"
    )


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--preset, --set and --dry-run: how every command that runs on a preset is configured."""
    parser.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        help=f"configs/<preset>.yaml or a path to a YAML file (default: {DEFAULT_PRESET}; "
        f"available: {', '.join(config_mod.preset_names()) or 'none here: run from the project, or give a path'})",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override config values, e.g. --set train.lr=1e-4 data.tasks_per_family=32; a value with "
        "spaces is one quoted word (--set 'data.families=[gcd, products]'); within a word a new "
        "override starts at each space followed by KEY=; --dry-run prints every key with its value",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit (families and their options checked against reasoning-gym)")


def _module(name: str) -> ModuleType:
    # `study` composes the steps, so it sits above them, not among them.
    default = "coopstudy.study" if name == "study" else f"coopstudy.steps.{name}"
    return importlib.import_module(TOOLS.get(name, default))


def _with_experiment(overrides: list[str]) -> list[str]:
    """The overrides, plus the experiment the user named outside the config
    (MLFLOW_EXPERIMENT_NAME, MLFLOW_EXPERIMENT_ID, `mlflow run --experiment-name`) unless
    `--set experiment=...` names one: that is the study's experiment then."""
    if any(o.split("=", 1)[0].strip() == "experiment" for o in overrides):
        return overrides
    from coopstudy.record import store

    named = store.chosen_experiment()
    # As a JSON string: YAML would read `123`, `null` or `a # b` as something
    # else. Not ASCII-escaped: YAML reads a JSON surrogate pair (an emoji's
    # \ud83d\ude42) as two lone halves, which MLflow cannot encode.
    return [*overrides, f"experiment={json.dumps(named, ensure_ascii=False)}"] if named else overrides


def _split_overrides(item: str) -> list[str]:
    """MLproject passes all overrides as one word, or an empty one. A word
    starts a new override only where a `key=` follows the space, so a value
    may hold spaces: `data.families=[gcd, products]`. Any `key=` starts one,
    known or not: a misspelt key is then refused by its name, not taken into
    the value before it."""
    return [o for o in re.split(r"\s+(?=[A-Za-z_][\w.]*=)", item.strip()) if o]


class _BadArguments(Exception):
    """A mistake in the arguments, as the parser of `prog` words it."""

    def __init__(self, prog: str, message: str):
        super().__init__(f"{message} (see `python -m {prog} --help`)")
        self.message = message
        self.step = prog.partition(" ")[2] or None


class _Parser(argparse.ArgumentParser):
    """A mistake in the arguments is refused as every other user mistake is
    (one line; under `mlflow run`, its run marked refused), not argparse's
    usage block; `--help` shows the usage."""

    def error(self, message: str) -> NoReturn:
        raise _BadArguments(self.prog, message)


class _Version(argparse.Action):
    """--version: the installed package's, looked up only when asked (the
    lookup reads every installed distribution's metadata: 50 ms a command)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the installed version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        from importlib import metadata

        try:
            version = metadata.version("coopstudy")
        except metadata.PackageNotFoundError:  # run from a checkout that was never installed
            version = "(not installed)"
        print(f"{parser.prog} {version}")
        parser.exit()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or with `only`, just that command's sub-parser: a command
    then imports no other command's module (some import torch at the top)."""
    # No abbreviations: `mlflow run` turns an unknown -P dry=1 into --dry 1,
    # which would otherwise be taken for --dry-run.
    parser = _Parser(
        prog="coopstudy",
        allow_abbrev=False,
        description=(
            "A pre-registered study: PowerSGD-compressed two-worker DDP fine-tuning against a "
            "single-device control, every step an MLflow run. The steps run in the order listed, "
            "prepare to report (`study` runs them all, reusing what is done); each refuses when a "
            f"commitment it depends on is missing or changed. {', '.join(TOOLS)}: "
            "tools beside them."
        ),
    )
    parser.add_argument("--version", action=_Version)
    parser.epilog = where_things_go()
    sub = parser.add_subparsers(dest="step", metavar="COMMAND", required=True)
    for name in (*STEPS, *TOOLS) if only is None else (only,):
        module = _module(name)
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            allow_abbrev=False,
            epilog=parser.epilog,
        )
        if name in STEPS:
            add_config_arguments(p)
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(named if named in STEPS or named in TOOLS else None)
    # Before parsing, where an undeclared -P help=1 would print the help and succeed.
    preset = argv[argv.index("--preset") + 1] if "--preset" in argv[:-1] else None
    undeclared = _undeclared(named, argv)
    if undeclared:
        return _refuse(argparse.Namespace(step=named, preset=preset), UserError(undeclared))
    early = _options_before_the_command(argv)
    if early:
        return _refuse(argparse.Namespace(step=None, preset=preset), UserError(early))
    early = _options_before_the_subcommand(parser, argv)
    if early:
        return _refuse(argparse.Namespace(step=argv[0], preset=preset), UserError(early))
    try:
        args, unknown = parser.parse_known_args(argv)
    except _BadArguments as err:
        return _refuse(argparse.Namespace(step=err.step, preset=preset), UserError(_as_parameters(err.step, err)))
    if unknown:
        return _refuse(args, UserError(_unrecognized(" ".join(_typed(args)), unknown)))
    try:
        if not hasattr(args, "preset"):
            return int(args._module.main(args) or 0)
        overrides = [o for item in args.overrides for o in _split_overrides(item)]
        cfg = config_mod.load(args.preset, _with_experiment(overrides))
        config_mod.remember_overrides(cfg, overrides)
        if args.dry_run:
            # Loading leaves the families to `prepare` (reasoning-gym takes a
            # second to import); a dry run is where a misspelt one should show.
            from coopstudy.inputs import tasks

            tasks.check_families(cfg.data.families, "data.families", cfg.data.family_options)
            # A dry run that passed what the step then refuses would mislead;
            # a command that runs another config than the loaded one
            # (dev-split's development config) returns it, and that is shown.
            check = getattr(_module(args.step), "check_arguments", None)
            shown = check(cfg, args) if check is not None else None
            print(config_mod.to_yaml(shown or cfg), end="")
            return 0
        code = _run_step(args.step, cfg, args)
        # A step may name the step that follows it on success (`probe --plan`):
        # steps never call each other, the parser runs them in turn.
        if code == 0 and getattr(args, "then", None):
            code = _run_step(args.then, cfg, args)
        return code
    except UserError as err:
        return _refuse(args, err)
    except KeyboardInterrupt as err:
        # A SIGTERM or SIGHUP (launch.Terminated) is told from a Ctrl-C, to the
        # user and to what started the step (`mlflow run`, a scheduler).
        signum = getattr(err, "signum", signal.SIGINT)
        said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(f"coopstudy {args.step}: {said}", file=sys.stderr)
        return 128 + signum
    except OSError as err:
        said = errors.os_error_said(err)
        if said is None:
            raise
        if err.errno in errors.FULL_DISK:
            # Not marked refused: the record may sit on the same full disk.
            print(f"coopstudy {args.step}: error: {said}", file=sys.stderr)
            return 2
        # A step run already open keeps the traceback (error.txt).
        return _refuse(args, UserError(said))
    except Exception as err:
        # The same for the tracking store's SQLite file, which MLflow's error only wraps.
        from coopstudy.record import store, writer

        locked = store.on_locked(err)
        if not (locked or store.on_full_disk(err)):
            raise
        kept = writer.ends_kept()
        if kept:
            runs = f" (run {', '.join(kept)} stays RUNNING until `python -m coopstudy remote deliver` ends it)"
        else:
            runs = "" if locked else " (a run this step had opened stays RUNNING)"
        said = f"{store.locked_said()}; run it again once that process is done" if locked else f"{store.full_disk_said()}; free some space and run it again"
        print(f"coopstudy {args.step}: error: {said}{runs}", file=sys.stderr)
        return 2


def _refuse(args: argparse.Namespace, err: UserError) -> int:
    """Say a user's mistake in one line, under the command as it was typed
    (`coopstudy bench arms:`, as the parser says its own); exit 2."""
    print(f"{' '.join(['coopstudy', *_typed(args)])}: error: {err}", file=sys.stderr)
    if args.step and os.environ.get("MLFLOW_RUN_ID"):  # no stage run took `mlflow run`'s over (that one unsets it)
        from coopstudy.record import writer

        preset = getattr(args, "preset", None)
        writer.mark_refused(f"{args.step}-{Path(preset).stem}" if preset else args.step, err)
    return 2


def _typed(args: argparse.Namespace) -> list[str]:
    """The command as the user typed it: the step, and bench's or remote's subcommand."""
    return [w for w in (args.step, *(getattr(args, dest, None) for dest in SUBCOMMAND_DESTS)) if w]


def _subcommands(parser: argparse.ArgumentParser, command: str) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of `command` (bench's, remote's) and their parsers, or none."""
    steps = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    inner = steps.choices[command]._actions if command in steps.choices else []
    return {name: sub for a in inner if isinstance(a, argparse._SubParsersAction) for name, sub in a.choices.items()}


def _options_before_the_subcommand(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """As _options_before_the_command, one level down: `bench --preset tiny
    objective` (argparse would take `tiny` for the benchmark)."""
    if len(argv) < 2 or not argv[1].startswith("-") or argv[1] in ("-h", "--help"):
        return None
    subparsers = _subcommands(parser, argv[0])
    if not subparsers:
        return None
    names = list(subparsers)
    subcommand = next((a for a in argv[2:] if a in names), None)
    if subcommand is None:
        # None at all (argparse would take `--preset tiny`'s `tiny` for one, and say it is no benchmark).
        option = argv[1].split("=", 1)[0]
        if not any(option in sub._option_string_actions for sub in subparsers.values()):
            return f"unrecognized arguments: {shlex.join(argv[1:])} ({argv[0]} takes a command first, one of {', '.join(names)}: see `python -m coopstudy {argv[0]} --help`)"
        return f"name the {argv[0]} command first: `python -m coopstudy {argv[0]} {{{','.join(names)}}} {shlex.join(argv[1:])}`"
    at = argv.index(subcommand, 2)
    return f"options go after the {argv[0]} command: `python -m coopstudy {shlex.join([argv[0], subcommand, *argv[1:at], *argv[at + 1 :]])}`"


def _options_before_the_command(argv: list[str]) -> str | None:
    """What is wrong with options given before the command, or None. (argparse
    would take `--preset tiny prepare`'s `tiny` for the command, and say of
    `--bogus` only that a command is missing.)"""
    if not argv or not argv[0].startswith("-") or argv[0] in ("-h", "--help", "--version"):
        return None
    command = next((a for a in argv if a in STEPS or a in TOOLS), None)
    if command is None:
        return f"unrecognized arguments: {' '.join(argv)} (a command comes first: see `python -m coopstudy --help`)"
    at = argv.index(command)
    return f"options go after the command: `python -m coopstudy {shlex.join([command, *argv[:at], *argv[at + 1 :]])}`"


def _unrecognized(step: str | None, unknown: list[str]) -> str:
    """What is wrong with arguments the parser does not know, in one line.
    (Under `mlflow run`, _undeclared has said any option -P gave already.)"""
    return f"unrecognized arguments: {' '.join(unknown)} (see `python -m coopstudy{f' {step}' if step else ''} --help`)"


def _as_parameters(step: str | None, err: _BadArguments) -> str:
    """A bad value of an option, said as the -P parameter that gave it where
    `mlflow run` started the step (`-P arm=contrl`, not `argument --arm`)."""
    launched = _started_entry(step)
    if launched is None:
        return str(err)
    entry, spec = launched
    said = err.message
    for option, name in re.findall(r"(--[\w-]+) \{(\w+)\}", str(spec.get("command", ""))):
        said = said.replace(f"argument {option}:", f"-P {name}:")
    return f"{said} (entry point {entry} of MLproject)"


def _undeclared(step: str | None, argv: list[str]) -> str | None:
    """Under `mlflow run`: options after the entry point's command. MLflow
    turns a -P NAME=VALUE the entry point does not declare into --NAME VALUE
    after it, which the parser would obey where NAME is an option, even one
    the command gives itself (`-P through=report` on train, `-P help=1`):
    said as the user wrote it."""
    launched = _started_entry(step)
    if launched is None:
        return None
    entry, spec = launched
    # The command's words fill argv's first places, each {parameter} one word
    # (MLflow quotes the value); a value that reads as an option is the
    # user's, and is said as the -P that gave it, not as an undeclared one.
    template = str(spec.get("command", "")).split()[3:]
    slots = [re.fullmatch(r"\{(\w+)\}", slot) for slot in template]
    if len(argv) < len(template) or any(not name and slot != word for slot, name, word in zip(template, slots, argv)):
        return None  # not the entry point's command line: typed by hand
    for name, word in zip(slots, argv):
        if name and word.startswith("-"):
            return f"-P {name[1]}: {word!r} starts with '-': a parameter gives a value, not an option (entry point {entry} of MLproject)"
    extra = [a.split("=", 1)[0][2:] for a in argv[len(template) :] if a.startswith("--")]
    return _not_parameters(entry, spec, extra) if extra else None


def _started_entry(step: str | None) -> tuple[str, dict[str, Any]] | None:
    """The MLproject entry point `mlflow run` started this process as, and its
    declaration (empty where MLproject cannot be read); None otherwise, and
    for a process that command started in turn."""
    if not (step and os.environ.get("MLFLOW_RUN_ID")):
        return None
    from coopstudy.record import writer

    entry = writer.launching_entry_point()
    if entry is None:
        return None
    import yaml

    from coopstudy import workspace

    try:
        spec = yaml.safe_load((workspace.project_root() / "MLproject").read_text())["entry_points"][entry]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        spec = None
    spec = spec if isinstance(spec, dict) else {}
    if str(spec.get("command", "")).split()[3:4] != [step]:
        return None
    return entry, spec


def _not_parameters(entry: str, spec: dict[str, Any], names: list[str]) -> str:
    declared = sorted(spec.get("parameters") or {})
    takes = f" (it takes {', '.join(f'-P {p}' for p in declared)})" if declared else ""
    return f"-P {', '.join(names)}: not a parameter of entry point {entry}{takes}"


def _run_step(name: str, cfg: config_mod.Config, args: argparse.Namespace) -> int:
    """Run step `name`; a step of the study started by itself carries the
    step key the study would give it, so a later study reuses its run.
    A SIGTERM or SIGHUP ends it as Ctrl-C does, its runs KILLED with the
    reason, and only the first of them counts (`mlflow run` follows a Ctrl-C
    with a SIGTERM, which would otherwise kill the process mid-record)."""
    from coopstudy.run import launch

    module = _module(name)
    with launch.stopping():
        if name not in STUDY_STAGES:
            return int(module.run(cfg, args) or 0)
        from coopstudy import study

        with study.alone(name, cfg, args):
            return int(module.run(cfg, args) or 0)


def _make_analysis_importable() -> None:
    # analysis/ (report reads the record with it, dev-split its screens) sits
    # beside src/ and is not installed with the package: from the project root
    # it is found already, from a folder below it through the root.
    if importlib.util.find_spec("analysis") is None:
        from coopstudy import workspace

        sys.path.append(str(workspace.project_root()))


def entry(argv: list[str] | None = None) -> None:
    machine.set_library_defaults()
    _make_analysis_importable()
    code = main(argv)
    # Python's exit would search every object torch and transformers made for
    # cycles: 1.0-1.2 s of every process that imported them (a rank, a stage
    # that scores), for memory the process gives back anyway. Frozen objects
    # are left out of that search; exit handlers, thread joins and flushes
    # still run (the outbox delivers at exit). A tiny train stage ended 2-3 s
    # sooner (2026-12-06, three each way).
    gc.freeze()
    sys.exit(code)
