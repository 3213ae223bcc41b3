"""conformance: goldens, backends, gates, reports and the `k3conf` CLI.

`conformance.Backend` (conformance.backends.external) builds a backend from a kernel author's cores. Importing the
package stays light (the pytest plugin does, in every pytest run): Backend's module needs NumPy and k3ref's cores,
not the cases, goldens or gates.
"""
from conformance.backends.external import Backend

__version__ = "0.1.0"
__all__ = ["Backend", "__version__"]
