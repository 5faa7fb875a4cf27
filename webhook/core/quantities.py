"""Kubernetes resource quantities, read exactly, written as the API server writes them, and turned into card shares."""

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


def _text_of(value: object) -> str:
    """A quantity's text as the API server reads it: a string as it is, a YAML or JSON number as written."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not math.isfinite(value)):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return str(value)
    mantissa, e, exp = repr(value).partition("e")
    return f"{mantissa}e{int(exp)}" if e else mantissa


# What resource.Quantity's String() writes: the rules of k8s.io/apimachinery's
# staging/src/k8s.io/apimachinery/pkg/api/resource/quantity.go (ParseQuantity, CanonicalizeBytes),
# amount.go (AsCanonicalBytes, AsCanonicalBase1024Bytes) and suffix.go, written again here.
_DECIMAL_SUFFIX = {exponent: suffix for suffix, exponent in _DECIMAL_SI.items()}
_BINARY_SUFFIX = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_NANO = 10**9
_MAX_BINARY = 2**63 - 1  # ParseQuantity caps binary amounts here


def canonical(value: object) -> str:
    """The form in which the API server stores and returns a quantity.

    The number keeps the kind of suffix it was written with (decimal SI ``k``, ``M``, ``m``...,
    binary SI ``Ki``, ``Mi``..., or a decimal exponent ``e3``) and is written with the largest
    suffix of that kind that leaves a whole number: ``1000`` -> ``1k``, ``1024Mi`` -> ``1Gi``,
    ``0.5`` -> ``500m``, ``1.5Gi`` -> ``1536Mi``, ``100m`` stays. A decimal suffix moves in steps
    of a thousand (``1500k`` stays, ``15e2`` -> ``1500``). A binary amount below 1024 in magnitude,
    or one that is no whole number, is written with decimal SI (``0.5Gi`` -> ``512Mi``, ``1.5Ki``
    -> ``1536``, ``.001Ki`` -> ``1024m``). Anything finer than a nano is rounded up, away from
    zero (``0.1n`` -> ``1n``); ``+`` signs go. Every zero is ``0``.

    One difference on purpose: for a few spellings that are already near canonical the API server
    hands back the text as written (``+1``, ``010``, ``1E3``, ``1.``); this gives the canonical text for
    them too, so that a manifest never relies on that.
    """
    text = _text_of(value)
    match = _QUANTITY.match(text)
    if not match:
        raise QuantityError(f"{text!r} is not a quantity")
    amount = _parse_text(text)
    if amount == 0:
        return "0"
    suffix = match["suffix"] or ""
    binary = match["exp"] is None and suffix in _BINARY_SI
    exponent_form = match["exp"] is not None
    sign = -1 if amount < 0 else 1
    magnitude = abs(amount)
    # ParseQuantity: finer than a nano rounds up (inf.RoundUp on the magnitude); a binary amount is
    # capped at 2^63-1, and one below 1 is decimal from then on.
    nanos = -(-magnitude.numerator * _NANO // magnitude.denominator)
    magnitude = Fraction(nanos, _NANO)
    if binary and magnitude > _MAX_BINARY:
        magnitude = Fraction(_MAX_BINARY)
    # CanonicalizeBytes: binary only for a whole number of 1024 or more in magnitude.
    if binary and (magnitude < 1024 or magnitude.denominator != 1):
        binary = False
    minus = "-" if sign < 0 else ""
    if binary:
        number, power = magnitude.numerator, 0
        while number % 1024 == 0 and power < len(_BINARY_SUFFIX) - 1:
            number //= 1024
            power += 1
        return f"{minus}{number}{_BINARY_SUFFIX[power]}"
    # AsCanonicalBytes: every factor of ten into the exponent, then down to a multiple of three.
    number, exponent = int(magnitude * _NANO), -9
    while number % 10 == 0:
        number //= 10
        exponent += 1
    while exponent % 3:
        number *= 10
        exponent -= 1
    if exponent_form:
        return f"{minus}{number}{f'e{exponent}' if exponent else ''}"
    if exponent not in _DECIMAL_SUFFIX:
        # quantity.go writes no suffix there at all, which would change the value.
        raise QuantityError(f"{text!r} is beyond the largest decimal suffix (E)")
    return f"{minus}{number}{_DECIMAL_SUFFIX[exponent]}"


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
