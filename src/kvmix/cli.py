"""The ``kvmix`` command line: one subcommand per module of ``kvmix.commands``."""

from __future__ import annotations

import argparse
import sys

from kvmix.commands import COMMANDS
from kvmix.evaluation import report


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    report.invocation = ["kvmix", *(sys.argv[1:] if argv is None else argv)]
    try:
        args.run(args)
    except ValueError as error:
        parser.exit(2, f"kvmix {args.command}: error: {error}\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmix", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
