"""The `k3conf` command line. Each subcommand lives in conformance/commands/<name>.py with register()."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import __version__, commands
from .commands import UsageError

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3conf",
        description="Conformance, error budgets and speed gates for the Kimi K3 decoder kernels.",
    )
    parser.add_argument("--version", action="version", version=f"k3conf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{mod.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    from .goldens import GoldenError

    try:
        return int(args.func(args) or 0)
    except (UsageError, GoldenError) as e:   # GoldenError here: an unreadable manifest or golden (regen, show)
        print(f"k3conf {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return EXIT_OK
    except OSError as e:   # a path the checks above did not foresee: still a named file, not a traceback
        print(f"k3conf {args.command}: {str(e.filename or '')[:300]}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
