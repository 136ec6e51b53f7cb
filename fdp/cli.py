"""The ``fdp`` command line: ``fdp version``, ``fdp launch`` (more join as they land)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from fdp._version import __version__
from fdp.launch import _cli as launch_cli

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
    launch = sub.add_parser(
        "launch",
        help="start the worker processes of a training script (torchrun)",
        description=launch_cli.DESCRIPTION,
    )
    launch_cli.add_arguments(launch)
    launch.set_defaults(run=lambda args: launch_cli.run(args, launch))
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
