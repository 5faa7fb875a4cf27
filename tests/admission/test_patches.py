"""We test:
- a patch turns the original into the new document, applied by jsonpatch, for any pair of JSON documents
  and for pairs that differ in a few places (as the core's rewrite makes them);
- equal documents give an empty patch; keys with "/" and "~" are escaped;
- a leaf whose JSON type changes (1 -> true, 1 -> 1.0) is replaced.
"""

from __future__ import annotations

import copy

import jsonpatch
from hypothesis import given, settings
from hypothesis import strategies as st

from webhook.admission import patches

LEAVES = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=5)
KEYS = st.text(alphabet="ab/~-", max_size=4)
DOCS = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
                    max_leaves=25)


def _applies(a, b) -> None:
    patch = patches.make(a, b)
    result = jsonpatch.apply_patch(copy.deepcopy(a), patch)
    assert result == b and _types(result) == _types(b), (a, b, patch)


def _types(doc):
    if isinstance(doc, dict):
        return {k: _types(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_types(v) for v in doc]
    return type(doc).__name__


@settings(max_examples=300, deadline=None)
@given(a=DOCS, b=DOCS)
def test_any_two_documents(a, b):
    _applies(a, b)


@settings(max_examples=300, deadline=None)
@given(a=st.dictionaries(KEYS, DOCS, max_size=5), data=st.data())
def test_documents_changed_in_a_few_places(a, data):
    b = copy.deepcopy(a)
    for _ in range(data.draw(st.integers(0, 3))):
        node = b
        while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            if not isinstance(node[key], (dict, list)):
                break
            node = node[key]
        if isinstance(node, dict):
            node[data.draw(KEYS)] = data.draw(DOCS)
        elif isinstance(node, list):
            node.append(data.draw(DOCS))
    _applies(a, b)


def test_equal_documents_give_an_empty_patch():
    doc = {"a": [1, {"b": "c"}], "d/e~f": None}
    assert patches.make(doc, copy.deepcopy(doc)) == []


def test_keys_are_escaped_and_types_count():
    assert patches.make({"a/b~c": 1}, {"a/b~c": 2}) == [{"op": "replace", "path": "/a~1b~0c", "value": 2}]
    assert patches.make({"x": 1}, {"x": True}) == [{"op": "replace", "path": "/x", "value": True}]
    assert patches.make([1], [1.0]) == [{"op": "replace", "path": "/0", "value": 1.0}]
    assert patches.make({"env": [1]}, {"env": [1, 2]}) == [{"op": "add", "path": "/env/-", "value": 2}]
