"""Every tolerance and effect size the tests use is a row with a number and the reason for it."""
from __future__ import annotations

from tests.support.tolerances import EFFECT, ELEMENT, TOL


def test_every_row_has_a_positive_bound_and_a_reason():
    for name, (bound, reason) in {**TOL, **EFFECT}.items():
        assert bound > 0 and reason.strip(), name
    for name, (rtol, atol, reason) in ELEMENT.items():
        assert rtol >= 0 and atol >= 0 and rtol + atol > 0 and reason.strip(), name
