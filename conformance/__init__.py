"""conformance: goldens, backends, gates, reports and the `k3conf` CLI."""

__version__ = "0.1.0"
