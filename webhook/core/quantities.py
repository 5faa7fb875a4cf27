"""Kubernetes resource quantities, read exactly, and their conversion to card shares."""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction

# The quantity grammar of k8s.io/apimachinery resource.Quantity.
_QUANTITY = re.compile(
    r"^(?P<sign>[+-]?)(?P<number>\d+(?:\.\d*)?|\.\d+)"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE](?P<exp>[+-]?\d+))?$"
)
_DECIMAL_SI = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SI = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}

# Far beyond any GPU count, small enough that exact arithmetic stays cheap on
# hostile input such as "1e999999999".
MAX_EXPONENT = 30
MAX_TEXT = 64


class QuantityError(ValueError):
    """A value that is not a Kubernetes quantity gpushard can use."""


def parse(value: object) -> Fraction:
    """Read a quantity as written in a manifest or an AdmissionReview, exactly."""
    if type(value) is str:  # the usual case, first: text, as every quantity is on the wire
        text = value.strip()
        if len(text) > MAX_TEXT:
            raise QuantityError(f"{text[:20]!r}... is too long to be a quantity")
        return _parse_text(text)
    if isinstance(value, bool) or value is None:
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise QuantityError(f"{value!r} is not a quantity")
        # repr() is the shortest text that reads back as this float: 0.1 stays 1/10.
        text = repr(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise QuantityError(f"{value!r} is not a quantity")
    if len(text) > MAX_TEXT:
        raise QuantityError(f"{text[:20]!r}... is too long to be a quantity")
    if "e" in text and isinstance(value, float):
        mantissa, _, exp = text.partition("e")
        text = f"{mantissa}e{int(exp)}"
    return _parse_text(text)


@functools.lru_cache(maxsize=1024)
def _parse_text(text: str) -> Fraction:
    """The exact value of quantity text. Cached: the same few asks ("250m", "0.5") come again
    and again, and Fraction arithmetic is the dearest part of reading a pod."""
    match = _QUANTITY.match(text)
    if not match:
        raise QuantityError(f"{text!r} is not a quantity")
    whole, _, frac = match["number"].partition(".")
    numerator = int(whole or "0") * 10 ** len(frac) + int(frac or "0")
    denominator = 10 ** len(frac)
    if match["sign"] == "-":
        numerator = -numerator
    suffix = match["suffix"] or ""
    if match["exp"] is not None:
        exponent = int(match["exp"])
        if abs(exponent) > MAX_EXPONENT:
            raise QuantityError(f"{text!r} is out of range")
    elif suffix in _BINARY_SI:
        numerator <<= _BINARY_SI[suffix]
        exponent = 0
    else:
        exponent = _DECIMAL_SI[suffix]
    if exponent >= 0:
        numerator *= 10 ** exponent
    else:
        denominator *= 10 ** -exponent
    return Fraction(numerator, denominator)


def to_shares(quantity: Fraction, shares_per_card: int) -> tuple[int, bool]:
    """Shares for a fraction of a card: ceil(q x sharesPerCard), and whether ceil rounded."""
    return shares_of(quantity.numerator, quantity.denominator, shares_per_card)


def shares_of(numerator: int, denominator: int, shares_per_card: int) -> tuple[int, bool]:
    """``to_shares`` of numerator/denominator (denominator > 0), for a caller that has the two."""
    # In integers: Fraction arithmetic costs microseconds.
    shares, rest = divmod(numerator * shares_per_card, denominator)
    return (shares + 1, True) if rest else (shares, False)


def decimal_text(value: Fraction, places: int = 6) -> str:
    """The shortest decimal text for a value: 1/4 -> "0.25", 1 -> "1", 1/3 -> "0.333333"."""
    scaled = round(value * 10**places)
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled), 10**places)
    if not frac:
        return f"{sign}{whole}"
    return f"{sign}{whole}.{frac:0{places}d}".rstrip("0")


@functools.lru_cache(maxsize=4096)
def fraction_text(shares: int, shares_per_card: int) -> str:
    """GPUSHARD_FRACTION for ``shares`` of a card."""
    return decimal_text(Fraction(shares, shares_per_card))


def is_integer(value: Fraction) -> bool:
    return value.denominator == 1
