"""The listing's and the usage's dates: every RFC 3339 date and time is taken (the fuzzer found
an offset that moved year 1 before the calendar's start, and leap seconds are RFC 3339's too);
what is not one is 400 naming its parameter."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from service.api.finding import rfc3339
from service.core.errors import InvalidInput


@pytest.mark.parametrize(
    ("given", "instant"),
    [
        ("2026-01-31T00:00:00Z", datetime(2026, 1, 31, tzinfo=UTC)),
        ("2026-01-31t01:30:00+01:30", datetime(2026, 1, 31, tzinfo=UTC)),
        ("0001-01-01T00:00:00+00:01", datetime.min.replace(tzinfo=UTC)),
        ("9999-12-31T23:59:59-01:00", datetime.max.replace(tzinfo=UTC)),
        ("2016-12-31T23:59:60Z", datetime(2016, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)),
    ],
)
def test_every_rfc3339_instant_is_taken(given: str, instant: datetime) -> None:
    assert rfc3339("updated_after", given) == instant


@pytest.mark.parametrize("given", ["", "2026-01-31", "2026-02-30T00:00:00Z", "yesterday"])
def test_what_is_not_one_is_refused_naming_its_parameter(given: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        rfc3339("updated_after", given)
    assert refused.value.param == "updated_after"
