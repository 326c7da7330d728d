"""The command line's commands: one module each, with a configuration dataclass, a ``run_*``
function and ``add_parser``. ``kvmix --help`` lists them by group, in this order."""

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
COMMANDS = tuple(module for modules in GROUPS.values() for module in modules)
