"""One module per `k3conf` subcommand; each exposes register(subparsers).

UsageError lives here, below both the subcommands that raise it and conformance.cli that prints it, so that
no subcommand imports the command line that imports it.
"""


class UsageError(Exception):
    """Bad usage or unreadable input: printed without a traceback, exit 2."""
