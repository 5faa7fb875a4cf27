"""We test:
- the fast reader gives exactly the standard library's answer (same values, same types) or refuses
  exactly what it refuses, on the documents where orjson and the standard library differ (integers
  outside 64 bits, lone surrogates, UTF-16, a byte order mark, deep nesting, NaN, infinities) and on
  any JSON document (hypothesis);
- the fast writer writes what the standard library reads back as the same document, also for what
  orjson cannot write (integers outside 64 bits, lone surrogates, deep nesting);
- an integer outside 64 bits in a pod reaches the patch as that integer, not as a float.
"""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.admission import objects
from webhook.admission import reviews, wirejson
from webhook.core import names
from webhook.settings import Settings


def same(a: object, b: object) -> bool:
    """Equal as JSON documents, types included (1 is not 1.0, True is not 1); no recursion, so a
    document nested as deep as a reader went can be compared."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if list(x) != list(y):
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif isinstance(x, float) and x != x:
            if y == y:
                return False
        elif x != y:
            return False
    return True


def outcome(read, body):
    try:
        return "ok", read(body)
    except (ValueError, RecursionError) as exc:
        return "refused", type(exc)


def assert_reads_as_stdlib(body) -> None:
    fast, slow = outcome(wirejson.loads, body), outcome(wirejson.loads_stdlib, body)
    assert fast[0] == slow[0], (body[:80], fast, slow)
    if fast[0] == "ok":
        assert same(fast[1], slow[1]), (body[:80], fast[1], slow[1])


EDGES = [
    b'{"a":18446744073709551615}',  # the largest unsigned 64-bit integer: orjson reads it as an int
    b'{"a":18446744073709551616}',  # one more: orjson would read a float
    b'{"a":-9223372036854775808}',
    b'{"a":-9223372036854775809}',
    b'{"a":123456789012345678901234567890}',
    b'{"a":1.2345678901234567890123}',
    b'{"a":"12345678901234567890"}',  # a long digit run inside a string
    b'{"a":1e400}', b'{"a":-1e400}', b'{"a":NaN}', b'{"a":Infinity}', b'{"a":4.9e-325}', b'{"a":-0.0}',
    b'{"a":"\\ud800"}', b'{"a":"\\udc00x"}', b'{"\\ud800":1}', b'{"a":"\xed\xa0\x80"}',
    b'\xef\xbb\xbf{"a":1}',
    '{"a":"é"}'.encode("utf-16"), '{"a":"é"}'.encode("utf-32-le"),
    b'[' * 1100 + b']' * 1100,
    b'[' * 100_000 + b']' * 100_000,
    b'{"a":1,"a":2}', b'{"a":"\x01"}', b'{"a":1}\x00', b'\t{"a":1}\r\n', b"", b"null", b'"x"',
    b'{"a":"\xff"}', b'{"a":01}', b'{"a":.5}', b'{"a":1.}', b'{"a":"\\u00e9\\/"}',
]


@pytest.mark.parametrize("body", EDGES, ids=range(len(EDGES)))
def test_edges_read_as_the_standard_library_reads_them(body):
    assert_reads_as_stdlib(body)
    assert_reads_as_stdlib(bytearray(body))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(JSON, st.booleans())
def test_any_document_reads_as_the_standard_library_reads_it(value, ascii_only):
    body = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert_reads_as_stdlib(body)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_what_is_written_reads_back_as_the_same_document(value):
    written = wirejson.dumps(value)
    assert isinstance(written, bytes)
    assert same(wirejson.loads_stdlib(written), value)


@pytest.mark.parametrize("value", [
    {"a": 10**20}, {"a": -(10**19)}, {"a": "\ud800"}, {"\udc00": 1},
    json.loads("[" * 300 + "]" * 300),
], ids=["big int", "big negative int", "lone surrogate", "surrogate key", "deep"])
def test_what_orjson_cannot_write_is_written_by_the_standard_library(value):
    assert same(wirejson.loads_stdlib(wirejson.dumps(value)), value)


def test_an_integer_outside_64_bits_reaches_the_patch_as_that_integer(view):
    big = 123456789012345678901234567890
    # The author's own NVIDIA_VISIBLE_DEVICES goes: the entries after it move up, and the patch
    # carries them, with every value they hold.
    env = [{"name": names.VISIBLE_DEVICES_ENV, "value": "all"}, {"name": "X", "value": "1", "extra": big}]
    pod = objects.pod(objects.container("train", "0.5", env=env))
    body = json.dumps(objects.review(pod, uid="u")).encode()
    settings_ = Settings()
    answer = reviews.review(body, names.MODE_ENFORCE, settings_.policy, view)
    assert answer.outcome == reviews.PATCHED
    patch = json.loads(base64.b64decode(answer.review["response"]["patch"]))
    text = json.dumps([op.get("value") for op in patch if op["path"].startswith("/spec/containers/0/env")])
    assert str(big) in text and "e+" not in text
