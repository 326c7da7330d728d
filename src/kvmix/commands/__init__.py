"""The command line's commands: one module each, with a configuration dataclass, a ``run_*``
function and ``add_parser``. ``kvmix --help`` lists them in this order."""

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

COMMANDS = (compare, bench, plan, longgen, needle, harness, criteria, pairscore, sweep, norms,
            keyfirst, recon, calibrate, transforms, export, recommend, methods, serve, loadtest,
            report)
