"""The ``fdp`` command line: ``fdp version`` (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from fdp._version import __version__

Command = Callable[[argparse.Namespace], int]


def _version(args: argparse.Namespace) -> int:
    del args
    print(f"fdp {__version__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fdp`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="fdp", description="PyTorch DDP's behaviour for JAX.")
    parser.add_argument("--version", action="version", version=f"fdp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("version", help="print fdp's version").set_defaults(run=_version)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fdp`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
