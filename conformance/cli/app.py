"""The `k3conf` command line. Each subcommand lives in conformance/cli/<name>.py with register(); COMMANDS lists
them."""
from __future__ import annotations

import argparse
import sys

from conformance import __version__
from conformance.cli import admit, blocks, calibrate, compare, decode, diff, fuzz, model, regen, run, show, synth
from conformance.cli import list as list_
from conformance.cli.usage import UsageError
from conformance.golden.errors import GoldenError
from conformance.session import SessionError

# `k3conf --help` lists them in this order
COMMANDS = (admit, blocks, calibrate, compare, decode, diff, fuzz, list_, model, regen, run, show, synth)

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3conf",
        description="Conformance, error budgets and speed gates for the Kimi K3 decoder kernels.",
    )
    parser.add_argument("--version", action="version", version=f"k3conf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if "func" not in args:   # no subcommand given
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    # SessionError: a run that cannot start; GoldenError: an unreadable manifest or golden (regen, show)
    except (UsageError, SessionError, GoldenError) as e:
        print(f"k3conf {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:   # Ctrl-C: one line, no traceback, and never the exit code of a finished run
        print(f"k3conf {args.command}: interrupted" + ("; no report was written" if args.command == "run" else ""),
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as e:     # code of ours never exits from inside a command: something loaded did
        print(f"k3conf {args.command}: stopped by sys.exit({e.code!r}) from code the command loaded (a backend?) "
              "before it finished; no report was written", file=sys.stderr)
        return EXIT_FAIL
    except OSError as e:   # a path the checks above did not foresee: still a named file, not a traceback
        print(f"k3conf {args.command}: {str(e.filename or '')[:300]}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
