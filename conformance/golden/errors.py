"""The one error a golden directory raises: storage, durability and regeneration all report through it."""
from __future__ import annotations


class GoldenError(Exception):
    """A golden file that cannot be used; the message names the file and how to regenerate it."""
