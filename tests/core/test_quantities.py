"""We test:
- every quantity form users and the API server write reads exactly (decimal, SI, binary, exponent);
- garbage, non-finite and absurd values are refused with the value quoted;
- shares are ceil(q x sharesPerCard), with the rounding flagged;
- GPUSHARD_FRACTION's shortest decimal text.
"""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from webhook.core import quantities


@pytest.mark.parametrize("text, value", [
    ("0.25", Fraction(1, 4)), ("250m", Fraction(1, 4)), ("1", 1), ("1e0", 1), ("1.5", Fraction(3, 2)),
    (".5", Fraction(1, 2)), ("5.", 5), ("-1", -1), ("+2", 2), ("3e-1", Fraction(3, 10)), ("1Ki", 1024),
    ("500000u", Fraction(1, 2)), ("1k", 1000), (0.333, Fraction(333, 1000)), (2, 2), (0.1, Fraction(1, 10)),
    ("  0.5 ", Fraction(1, 2)), (1e-3, Fraction(1, 1000)),
])
def test_reads_exactly(text, value):
    assert quantities.parse(text) == value


@pytest.mark.parametrize("bad", ["abc", "", "1.2.3", "0.5x", "1e999999", "1" * 200, "--1", "1 e3", True, None,
                                 float("nan"), float("inf"), [], {}, "0x10"])
def test_refuses_garbage(bad):
    with pytest.raises(quantities.QuantityError) as err:
        quantities.parse(bad)
    assert "quantity" in str(err.value) or "range" in str(err.value) or "long" in str(err.value)


@pytest.mark.parametrize("q, spc, shares, rounded", [
    ("0.25", 100, 25, False), ("0.333", 100, 34, True), ("0.001", 100, 1, True), ("0.5", 8, 4, False),
    ("0.3", 8, 3, True), ("1", 100, 100, False),
])
def test_shares_round_up(q, spc, shares, rounded):
    assert quantities.to_shares(quantities.parse(q), spc) == (shares, rounded)


@pytest.mark.parametrize("shares, spc, text", [(25, 100, "0.25"), (50, 100, "0.5"), (100, 100, "1"),
                                               (1, 3, "0.333333"), (34, 100, "0.34"), (1, 1000, "0.001")])
def test_fraction_text(shares, spc, text):
    assert quantities.fraction_text(shares, spc) == text


@given(st.integers(min_value=1, max_value=999), st.sampled_from(["", "m"]))
def test_milli_and_decimal_agree(n, suffix):
    text = f"{n}{suffix}"
    value = quantities.parse(text)
    assert value == (Fraction(n, 1000) if suffix == "m" else n)
    shares, _ = quantities.to_shares(value, 100)
    assert shares >= value * 100 > shares - 1
