"""The ``kvmix`` command line: one subcommand per module of ``kvmix.commands``."""

from __future__ import annotations

import sys

from kvmix.commands import parser as make_parser
from kvmix.jobs import report


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    report.invocation = ["kvmix", *(sys.argv[1:] if argv is None else argv)]
    try:
        args.run(args)
    except ValueError as error:
        parser.exit(2, f"kvmix {args.command}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
