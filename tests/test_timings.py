"""The timings of a batch's life keep their order (genq.core.timings.check)."""

from __future__ import annotations

import pytest

from genq.core import timings


def test_the_shipped_timings_keep_their_order() -> None:
    timings.check()
    assert timings.LEASE_CHECK_STALE_S < timings.LEASE_TIMEOUT_S < timings.STATUS_TTL_S


@pytest.mark.parametrize(("name", "value", "reason"), [
    ("LEASE_CHECK_STALE_S", 12.0, "a frozen sender must stop before its lease can pass on"),
    ("STATUS_TTL_S", 9, "a worker is shown lost only once its leases have lapsed"),
    ("BEAT_S", 4.0, "a lease must survive two missed beats"),
    ("STRANDED_CONFIRM_S", 10.0, "two passes must be able to confirm a stranded batch"),
])
def test_an_edit_that_breaks_the_order_is_refused_with_the_reason(monkeypatch, name, value, reason) -> None:
    monkeypatch.setattr(timings, name, value)
    with pytest.raises(RuntimeError, match=reason):
        timings.check()
