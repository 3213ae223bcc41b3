"""One module per `k3conf` subcommand; each exposes register(subparsers)."""
