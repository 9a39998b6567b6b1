"""The ``coat`` command line: ``coat <command> [options]``.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds its
parser and sets ``handler`` (a callable taking the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from typing import Sequence

# Add a module here to add a subcommand (e.g. "coat.cli.bench", "coat.cli.estimate").
SUBCOMMAND_MODULES = ("coat.cli.train", "coat.cli.estimate", "coat.cli.bench")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None`` ones: their help text says what they resolve to. Lines
    break between words only: argparse's wrapping also breaks at hyphens, which cut recipe and
    flag names (``coat-lean``, ``out-of-memory``) in two."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False,
                             break_long_words=False)


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


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown flag is reported with the usage of the command
    it was given to (``coat train --bogus`` prints ``coat train``'s usage, not ``coat``'s)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(build_parser(), argv)  # imports every command's module: seconds, for torch
        code = args.handler(args)
        sys.stdout.flush()  # a reader that went away (`coat estimate | head`) shows up here, not at exit
        return code
    except BrokenPipeError:
        # As a SIGPIPE would: stop quietly. stdout goes to /dev/null so that the interpreter's own
        # flush at exit does not fail again with a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, the shell's status for a process ended by a closed pipe
    except BaseException as e:
        if not interrupted(e):
            raise
        print("\ncoat: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
