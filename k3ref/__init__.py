"""k3ref: exact NumPy references for every block of the Kimi K3 decoder.

Every function computes in the floating dtype it is given: float64 for goldens,
float32 to measure error budgets. See docs/spec.md and docs/interfaces.md.
"""

__version__ = "0.1.0"
