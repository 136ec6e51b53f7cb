"""``fdp launch`` and ``python -m fdp.launch``: the command line of the agent."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
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

    With ``script_args=True`` (``fdp launch``'s parser), the first positional argument
    is the script and everything after it is the script's, unchanged, as torchrun passes
    it: argparse never reads it, so ``train.py --n 3`` is not taken for an abbreviation
    of a launcher option. It is set as the namespace's ``script_args``.
    """

    def __init__(self, *args: Any, script_args: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.script_args = script_args

    def _get_option_tuples(self, option_string: str) -> list:  # type: ignore[override]
        by_action: dict[int, Any] = {}
        for option in super()._get_option_tuples(option_string):
            by_action.setdefault(id(option[0]), option)
        return list(by_action.values())

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        if not self.script_args:
            return super().parse_known_args(args, namespace)
        argv = list(sys.argv[1:] if args is None else args)
        end = self._script_end(argv)
        parsed, extras = super().parse_known_args(argv[:end], namespace)
        parsed.script_args = tuple(argv[end:])
        return parsed, extras

    def _script_end(self, argv: list[str]) -> int:
        """The index just after the script in ``argv`` (its length when there is none)."""
        i = 0
        while i < len(argv):
            token = argv[i]
            if token == "--":  # what follows is the script, even if it starts with "-"
                return min(i + 2, len(argv))
            if not token.startswith("-") or token == "-":
                return i + 1
            i += 2 if self._takes_value(token) else 1
        return len(argv)

    def _takes_value(self, token: str) -> bool:
        """Whether option ``token`` takes the next argument as its value.

        ``token`` is a launcher option or its abbreviation; an unknown or ambiguous one
        takes none (argparse names it when it parses the options).
        """
        if "=" in token:
            return False
        known = self._option_string_actions
        if token in known:
            actions = {id(known[token]): known[token]}
        elif token.startswith("--") and self.allow_abbrev:
            actions = {id(a): a for name, a in known.items() if name.startswith(token)}
        else:
            actions = {}
        return len(actions) == 1 and next(iter(actions.values())).nargs != 0


def build_parser(prog: str = "fdp launch") -> argparse.ArgumentParser:
    """The argument parser of ``fdp launch``."""
    parser = Parser(
        prog=prog,
        script_args=True,
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
