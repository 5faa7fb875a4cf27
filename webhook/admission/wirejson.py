"""AdmissionReview JSON read and written fast, with exactly the standard library's answers.

A review spends about a sixth of its time in the standard library's JSON: parsing the body and
encoding the patch and the response (bench/review.py). orjson does both several times faster,
but reads some documents differently, so it is used only where its answer is the standard
library's and everything else goes the standard library's way:

- an integer outside 64 bits becomes a float in orjson (the pod would come back with 1e+20
  where its author wrote an integer): a body with a run of 19 or more digits anywhere, which
  every such integer has, is read by the standard library;
- orjson refuses what the standard library reads with gpushard's options (lone surrogates,
  UTF-16 and UTF-32 bodies, a byte order mark, nesting past 1,024 levels): on any refusal the
  body is read again by the standard library, which decides;
- orjson never reads NaN or an infinity, nor do gpushard's options for the standard library.

Written the other way, orjson refuses integers outside 64 bits, lone surrogates and deep
nesting (TypeError), and then the standard library writes the document. Both write valid JSON
for the same values; orjson writes non-ASCII text as UTF-8 where the standard library escapes it.
orjson would write NaN as null, but nothing gpushard writes holds one: a body with NaN is refused.
Without orjson installed (it is a dependency; a platform without its wheel still works) the
standard library does everything.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

try:
    import orjson
except ImportError:  # no wheel for this platform: the standard library alone
    orjson = None


def _no_constant(name: str) -> None:
    # Python reads NaN and Infinity; JSON has neither, and no API server sends them.
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is out of range")
    return value


# Built once: json.loads and json.dumps with options build a new decoder or encoder per call.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)
# What gpushard writes holds parts of a parsed body and its own values: no cycles to look for.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, check_circular=False)

# Digits to "0", everything else to " ": a long run of digits is then one substring search.
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19  # the shortest integer outside 64 bits has 19 digits (-9223372036854775809)


def loads_stdlib(body: bytes | bytearray | str) -> object:
    """The document as the standard library reads it with gpushard's options; ValueError or
    RecursionError when it is not JSON."""
    if isinstance(body, (bytes, bytearray)):
        # As json.loads reads bytes (UTF-8, -16 or -32), with one decoder built once, not per body.
        body = body.decode(json.detect_encoding(body), "surrogatepass")
    elif not isinstance(body, str):
        raise TypeError(f"the JSON object must be str, bytes or bytearray, not {type(body).__name__}")
    if body.startswith("\ufeff"):
        raise ValueError("unexpected UTF-8 BOM")
    return _DECODER.decode(body)


def _loads_fast(body: bytes | bytearray | str) -> object:
    if type(body) is bytes and _LONG_RUN not in body.translate(_DIGITS):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # the standard library decides, and says why
    return loads_stdlib(body)


def dumps_stdlib(value: object) -> bytes:
    """Compact JSON as the standard library writes it (NaN and infinities refused)."""
    return _ENCODER.encode(value).encode("utf-8", "surrogatepass")


def _dumps_fast(value: object) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer outside 64 bits, a lone surrogate, deep nesting
        return dumps_stdlib(value)


loads: Callable[[bytes | bytearray | str], object] = _loads_fast if orjson is not None else loads_stdlib
dumps: Callable[[object], bytes] = _dumps_fast if orjson is not None else dumps_stdlib
