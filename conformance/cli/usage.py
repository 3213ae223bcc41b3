"""One module per `k3conf` subcommand; each exposes register(subparsers).

UsageError lives here, below both the subcommands that raise it and conformance.cli that prints it, so that
no subcommand imports the command line that imports it.
"""
from __future__ import annotations

import k3cuda


class UsageError(Exception):
    """Bad usage or unreadable input: printed without a traceback, exit 2."""


def check_cuda_env() -> None:
    """UsageError when the environment holds a K3_CUDA_* name k3cuda does not read (a misspelt escape would
    otherwise leave the kernel it meant to turn off running), or a value that is neither on nor off."""
    try:
        k3cuda.check_env()
    except ValueError as e:
        raise UsageError(str(e)) from None
