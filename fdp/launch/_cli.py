"""``fdp launch`` and ``python -m fdp.launch``: the command line of the agent."""

from __future__ import annotations

import argparse
import sys

from fdp.launch._agent import launch
from fdp.launch._config import add_arguments as add_arguments
from fdp.launch._config import from_namespace

DESCRIPTION = """\
Start NPROC worker processes of a training script on this host, as torchrun does:
each gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and
MASTER_PORT (read by fdp.init()), its own GPU(s) or share of CPU cores, and its output
prefixed with [rank N]. When any worker fails, the others are stopped, the group is
restarted up to --max-restarts times, and a summary names the failed rank."""


def build_parser(prog: str = "fdp launch") -> argparse.ArgumentParser:
    """The argument parser of ``fdp launch``."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs the agent with parsed arguments (bad options exit with status 2)."""
    try:
        cfg = from_namespace(args)
    except ValueError as e:
        parser.error(str(e))
    return launch(cfg)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fdp.launch``."""
    parser = build_parser("python -m fdp.launch")
    return run(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
