"""`python -m coopstudy <step>`: one parser, one module per step.

Each step module in `coopstudy.stages` defines `HELP` (its one-line summary),
`DESCRIPTION` (what it reads and writes), optionally `add_arguments(parser)`,
and `run(cfg, args) -> int | None`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from coopstudy import config as config_mod
from coopstudy.errors import UserError

# In protocol order; `--help` lists them so.
STEPS = ("prepare", "verify", "probe", "plan", "train", "select", "evaluate", "report", "study")
DEFAULT_PRESET = "smollm2-135m-cpu"


def _step_module(name: str):
    try:
        return importlib.import_module(f"coopstudy.stages.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"coopstudy.stages.{name}":
            return None
        raise


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or with `only`, just that step's sub-parser: a step then
    imports no other step's module (some import torch at the top)."""
    parser = argparse.ArgumentParser(
        prog="coopstudy",
        description=(
            "A pre-registered study: PowerSGD-compressed two-worker DDP fine-tuning against a "
            "single-device control, every step an MLflow run. Steps run in the order listed; "
            "each refuses when a commitment it depends on is missing or changed."
        ),
    )
    sub = parser.add_subparsers(dest="step", metavar="STEP", required=True)
    for name in STEPS if only is None else (only,):
        module = _step_module(name)
        if module is None:
            continue
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument(
            "--preset",
            default=DEFAULT_PRESET,
            help=f"configs/<preset>.yaml or a path to a YAML file (default: {DEFAULT_PRESET}; "
            f"available: {', '.join(config_mod.preset_names())})",
        )
        p.add_argument(
            "--set",
            dest="overrides",
            action="extend",
            nargs="*",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value, e.g. --set train.lr=1e-4 data.tasks_per_family=32",
        )
        p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(named if named in STEPS else None)
    args = parser.parse_args(argv)
    try:
        # MLproject passes all overrides as one word, or an empty one.
        overrides = [o for item in args.overrides for o in item.split()]
        cfg = config_mod.load(args.preset, overrides)
        if args.dry_run:
            print(config_mod.to_yaml(cfg), end="")
            return 0
        return int(args._module.run(cfg, args) or 0)
    except UserError as err:
        print(f"coopstudy {args.step}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"coopstudy {args.step}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    # One device is `threads_per_device` cores; stages set torch's thread count
    # from the config, and this keeps library pools from oversubscribing first.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
