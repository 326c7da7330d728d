"""The command line's commands: one module each, with a configuration dataclass, a ``run_*``
function and ``add_parser``. ``kvmix --help`` lists them by group, in this order."""

import argparse
from importlib import metadata

from kvmix.commands import (
    bench,
    calibrate,
    compare,
    criteria,
    export,
    harness,
    keyfirst,
    loadtest,
    longgen,
    methods,
    needle,
    norms,
    pairscore,
    plan,
    recommend,
    recon,
    report,
    serve,
    sweep,
    transforms,
)

GROUPS = {
    "measure methods against the float cache": (compare, bench, longgen, needle, harness,
                                                 methods),
    "choose, deploy and serve": (plan, recommend, calibrate, export, serve, loadtest, report),
    "research studies": (sweep, criteria, pairscore, keyfirst, norms, recon, transforms),
}

ABOUT = """\
kvmix: truly packed low-bit KV caches for transformers LLMs. Measure what a method
saves and costs against the float cache, plan what fits, serve it."""


def parser() -> argparse.ArgumentParser:
    """``kvmix``'s parser: every command, listed by group in ``--help``."""
    parser = argparse.ArgumentParser(prog="kvmix", usage="kvmix [-h] [--version] COMMAND ...",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"kvmix {metadata.version('kvmix')}",
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
    """Each command's parser by name, from ``parser()``'s (for checks and references)."""
    return next(action.choices for action in parser._actions
                if isinstance(action, argparse._SubParsersAction))


def _listing(names: dict[str, list[str]], about: dict[str, str]) -> str:
    """``kvmix --help``'s description: what kvmix is, then each group's commands."""
    lines = [ABOUT]
    for group, commands in names.items():
        lines += ["", f"{group}:", *(f"  {name:<11} {about[name]}" for name in commands)]
    lines += ["", "kvmix COMMAND --help describes a command's options."]
    return "\n".join(lines)
