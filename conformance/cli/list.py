"""`k3conf list`: the cases, the backends (available here or why not), the mutants and the gate table."""
from __future__ import annotations

from conformance.backends.protocol import ALL_CORES
from conformance.backends.registry import MUTANTS, ON_REQUEST
from conformance.cases.catalog import all_cases
from conformance.cases.protocol import CONFIGS
from conformance.cli.usage import UsageError, check_cuda_env
from conformance.isolation.client import WorkerPool
from conformance.judge.gates import BASELINE, BASELINE_GATES, FREE_MARGIN_BUDGETS, GATES, MARGIN_BUDGETS
from conformance.session import SessionError, backend_checks

SECTIONS = ("cases", "backends", "mutants", "gates")


def register(sub) -> None:
    p = sub.add_parser("list", help="list cases, backends (with availability), mutants and gates")
    # no `choices=`: Python 3.11's argparse checks the empty default of nargs="*" against them and rejects a
    # plain `k3conf list`; the sections are checked in run()
    p.add_argument("what", nargs="*", metavar="{" + ",".join(SECTIONS) + "}", help="sections to show (default: all)")
    p.add_argument("--config", choices=CONFIGS, default="tiny", help="case set (default tiny)")
    p.set_defaults(func=run)


def run(args) -> int:
    check_cuda_env()
    unknown = [w for w in args.what if w not in SECTIONS]
    if unknown:
        raise UsageError(f"unknown section(s) {unknown}; expected any of {list(SECTIONS)}")
    what = args.what or SECTIONS
    if "cases" in what:
        cases = all_cases(args.config)
        print(f"cases ({args.config}, {len(cases)}):")
        for c in cases:
            print(f"  {c.name:48s} kind={c.kind} seed={c.seed}")
    if "backends" in what:
        print("backends (each but the NumPy references loaded by a worker process of its own):")
        pool = WorkerPool()
        try:
            checks = backend_checks(None, pool)
        except SessionError as e:
            raise UsageError(str(e)) from None
        finally:
            pool.close()
        for check in checks:
            own = check.kernel_cores if check.available else ALL_CORES
            only = "" if own == ALL_CORES else f" [kernels: {', '.join(sorted(own))}; other cores: k3ref's]"
            state = "refused" if check.refused else "available" if check.available else "skipped"
            print(f"  {check.name:12s} {check.backend.precision:5s} {state}: {check.refused or check.reason}{only}")
        print(f"  run only when named with --backend: {', '.join(ON_REQUEST)}")
    if "mutants" in what:
        print("mutants (run with --backend mutant:<name>):")
        width = max(map(len, MUTANTS), default=0)
        for name, m in MUTANTS.items():
            print(f"  mutant:{name:{width}s} first failure expected in {m.block}: {m.description}")
    if "gates" in what:
        print("gates (block, tensor, precision): cap, k, floor -- reason:")
        for (block, tensor, prec), g in GATES.items():
            k = "-" if g.k is None else f"{g.k:g}"
            elem = "" if g.elem_k is None else f", worst element <= {g.elem_k:g} x baseline's + {g.elem_floor:g}"
            print(f"  ({block}, {tensor}, {prec}): cap {g.cap:g}, k {k}, floor {g.floor:g}{elem} -- {g.reason}"
                  + (f"; per-element: {g.elem_why}" if g.elem_k is not None else ""))
        print("baseline gates (the baseline of a precision is judged by these absolute caps, never by itself;"
              f" {', '.join(f'{p}: {b}' for p, b in BASELINE.items())}):")
        for (block, tensor, prec), g in BASELINE_GATES.items():
            print(f"  ({block}, {tensor}, {prec}): cap {g.cap:.3g} -- {g.reason}")
        print("near-tie budgets (model traces: a golden margin below this is teacher-forced and counted):")
        for mode, table in (("layerwise", MARGIN_BUDGETS), ("free", FREE_MARGIN_BUDGETS)):
            for prec, budgets in table.items():
                for choice, (value, why) in budgets.items():
                    print(f"  {prec} {choice} ({mode} traces): {value:g} -- {why}")
    return 0
