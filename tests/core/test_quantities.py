"""We test:
- every quantity form users and the API server write reads exactly (decimal, SI, binary, exponent);
- garbage, non-finite and absurd values are refused with the value quoted;
- shares are ceil(q x sharesPerCard), with the rounding flagged;
- GPUSHARD_FRACTION's shortest decimal text;
- the canonical form the API server stores a quantity in (resource.Quantity's String()), on known pairs:
  the suffix kind kept, the largest whole suffix, binary below 1024 or fractional written as decimal,
  finer than a nano rounded up, binary capped at 2^63-1; canonical text is a fixed point that keeps the value.
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


@pytest.mark.parametrize("text, stored", [
    # resource.Quantity's own ParseEmit pairs, and their negatives below.
    ("1Ki", "1Ki"), ("1Mi", "1Mi"), ("1Gi", "1Gi"), ("1024Mi", "1Gi"), ("1000M", "1G"), (".001Ki", "1024m"),
    (".000001Ki", "1024u"), (".000000001Ki", "1024n"), (".000000000001Ki", "2n"),
    # Decimal SI: the largest suffix that keeps a whole number, in steps of a thousand.
    ("1000", "1k"), ("0.5", "500m"), ("100m", "100m"), ("1.5", "1500m"), ("2000m", "2"), ("0.25", "250m"),
    ("3000000", "3M"), ("1500k", "1500k"), ("1024", "1024"), ("1", "1"), ("1.", "1"), (".5", "500m"),
    ("0.1n", "1n"), ("1000E", None),
    # Binary SI: whole multiples of 1024 keep it; below 1024 or fractional become decimal SI.
    ("1.5Gi", "1536Mi"), ("0.5Gi", "512Mi"), ("1.5Ki", "1536"), ("1024Ki", "1Mi"), ("1023Ki", "1023Ki"),
    ("5120Mi", "5Gi"), ("10Gi", "10Gi"), ("0.5Ki", "512"), ("16Ei", "9223372036854775807"),
    # A decimal exponent stays one.
    ("12e6", "12e6"), ("15e2", "1500"), ("1.5e3", "1500"), ("1E3", "1e3"), ("1e-10", "1e-9"), ("10e3", "10e3"),
    # Signs, zeros and numbers as YAML reads them.
    ("+1", "1"), ("010", "10"), ("0", "0"), ("0Mi", "0"), ("-0", "0"), ("0.0e5", "0"), (1000, "1k"), (0.5, "500m"),
    (2, "2"), (1e-05, "10e-6"),
])
def test_the_canonical_form_is_what_the_api_server_stores(text, stored):
    if stored is None:
        with pytest.raises(quantities.QuantityError, match="beyond the largest decimal suffix"):
            quantities.canonical(text)
        return
    assert quantities.canonical(text) == stored
    if isinstance(text, str) and stored != "0":
        assert quantities.canonical("-" + text.lstrip("+")) == "-" + stored


@pytest.mark.parametrize("bad", ["", "1 Gi", " 1", "1K", "1.2.3", "Mi", "1e", "0x10", True, None, float("inf"), []])
def test_the_canonical_form_of_garbage_is_refused(bad):
    with pytest.raises(quantities.QuantityError):
        quantities.canonical(bad)


@given(st.integers(min_value=-(10**9), max_value=10**9), st.integers(min_value=0, max_value=9),
       st.sampled_from(["", "m", "k", "M", "G", "Ki", "Mi", "Gi", "e3", "e-2"]))
def test_canonical_text_is_a_fixed_point_that_keeps_the_value(whole, places, suffix):
    text = f"{whole / 10**places:.{places}f}{suffix}" if places else f"{whole}{suffix}"
    stored = quantities.canonical(text)
    assert quantities.canonical(stored) == stored
    value = quantities.parse(text)
    if (value * 10**9).denominator == 1 and abs(value) < 2**63:  # neither rounded nor capped
        assert quantities.parse(stored) == value
