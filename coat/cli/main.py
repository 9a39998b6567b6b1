"""The ``coat`` command line: ``coat <command> [options]``.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds its
parser and sets ``handler`` (a callable taking the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# Add a module here to add a subcommand (e.g. "coat.cli.bench", "coat.cli.estimate").
SUBCOMMAND_MODULES = ("coat.cli.train", "coat.cli.estimate", "coat.cli.bench")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None`` ones: their help text says what they resolve to."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class CoatArgumentParser(argparse.ArgumentParser):
    # Subparsers are created with the parent's class, so they inherit this formatter too.
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = CoatArgumentParser(
        prog="coat",
        description="COAT: memory-efficient FP8 training for PyTorch.",
        epilog="Run 'coat <command> --help' for the options of a command.",
    )
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="<command>", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def interrupted(e: BaseException) -> bool:
    """Whether ``e`` is, or was raised while handling, a Ctrl-C (libraries such as transformers'
    lazy imports turn a KeyboardInterrupt into another error)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # imports every command's module: seconds, for torch
        return args.handler(args)
    except BaseException as e:
        if not interrupted(e):
            raise
        print("\ncoat: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
