"""``fdp launch`` and ``python -m fdp.launch``: the command line of the agent."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fdp.launch._agent import launch
from fdp.launch._config import add_arguments as add_arguments
from fdp.launch._config import from_namespace

DESCRIPTION = """\
Start N worker processes of a training script on this host, as torchrun does: each gets
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT
(read by fdp.init()), its own GPU(s) or share of CPU cores, and its output prefixed with
[rank N], line by line (progress bars are redrawn for one rank). When any worker fails,
the others are stopped, the group is restarted up to --max-restarts times, and a summary
names the failed rank; every run ends with a table of how each worker ended.
Set FDP_DEBUG=INFO to see the transport's connection logs too."""
USAGE = "%(prog)s [options] script.py [script args] | %(prog)s [options] -m module [args]"


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that takes an abbreviation of one option's two spellings.

    ``--nproc`` is a prefix of ``--nproc-per-node`` and ``--nproc_per_node``,
    two names of one option: argparse calls it ambiguous; here it is that option.
    """

    def _get_option_tuples(self, option_string: str) -> list:  # type: ignore[override]
        by_action: dict[int, Any] = {}
        for option in super()._get_option_tuples(option_string):
            by_action.setdefault(id(option[0]), option)
        return list(by_action.values())


def build_parser(prog: str = "fdp launch") -> argparse.ArgumentParser:
    """The argument parser of ``fdp launch``."""
    parser = Parser(
        prog=prog,
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs the agent with parsed arguments (bad options exit with status 2)."""
    try:
        cfg = from_namespace(args)
    except ValueError as e:
        parser.error(str(e))
    return launch(cfg)


HINT = "the launcher's options come before the script, the script's own after it"


def reject_unknown(
    parser: argparse.ArgumentParser, extras: list[str], hint: str | None = HINT
) -> None:
    """Exits with ``parser``'s usage and an error naming ``extras`` (options it does not know)."""
    if extras:
        why = f"see --help; {hint}" if hint else "see --help"
        parser.error(f"unrecognized arguments: {' '.join(extras)} ({why})")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fdp.launch``."""
    parser = build_parser("python -m fdp.launch")
    args, extras = parser.parse_known_args(argv)
    reject_unknown(parser, extras)
    return run(args, parser)


if __name__ == "__main__":
    sys.exit(main())
