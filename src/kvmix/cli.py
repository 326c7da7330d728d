"""The ``kvmix`` command line: one subcommand per module of ``kvmix.commands``."""

from __future__ import annotations

import argparse
import sys

from kvmix import __version__
from kvmix.commands import GROUPS
from kvmix.evaluation import report

ABOUT = """\
kvmix: truly packed low-bit KV caches for transformers LLMs. Measure what a method
saves and costs against the float cache, plan what fits, serve it."""


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
    parser = argparse.ArgumentParser(prog="kvmix", usage="kvmix [-h] [--version] COMMAND ...",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvmix {__version__}",
                        help="print kvmix's version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     prog="kvmix", help=argparse.SUPPRESS)  # listed by group
    names = {}
    for group, modules in GROUPS.items():
        known = len(commands.choices)
        for module in modules:
            module.add_parser(commands)
        names[group] = list(commands.choices)[known:]
    about = {action.dest: action.help for action in commands._choices_actions}
    for name, command in commands.choices.items():
        command.description = command.description or about[name]
    parser.description = _listing(names, about)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's parser by name, from ``_parser()``'s (for checks and references)."""
    return next(action.choices for action in parser._actions
                if isinstance(action, argparse._SubParsersAction))


def _listing(names: dict[str, list[str]], about: dict[str, str]) -> str:
    """``kvmix --help``'s description: what kvmix is, then each group's commands."""
    lines = [ABOUT]
    for group, commands in names.items():
        lines += ["", f"{group}:", *(f"  {name:<11} {about[name]}" for name in commands)]
    lines += ["", "kvmix COMMAND --help describes a command's options."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
