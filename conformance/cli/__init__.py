"""The k3conf command line: one module per subcommand (conformance/cli/<name>.py, each with register())."""
from conformance.cli.app import main

__all__ = ["main"]
