"""Thin entry point: `python tools/regen_goldens.py [args]` == `k3conf regen [args]`."""
import sys

from conformance.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["regen", *sys.argv[1:]]))
