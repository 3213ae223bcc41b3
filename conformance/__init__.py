"""conformance: goldens, backends, gates, reports and the `k3conf` CLI.

`conformance.Backend` (conformance.backends.external) builds a backend from a kernel author's cores; it is imported
on first use so that importing the package (the pytest plugin does, in every pytest run) stays cheap.
"""

__version__ = "0.1.0"
__all__ = ["Backend", "__version__"]


def __getattr__(name: str):
    if name == "Backend":
        from conformance.backends.external import Backend

        return Backend
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")
