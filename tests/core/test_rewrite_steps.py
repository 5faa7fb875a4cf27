"""The rewrite's steps on one container.

- Setting a share-holding container's env entries (rewrite.set_env) leaves each name once, with its value,
  after every other entry in its place, for every shape of env list: absent, no list, holding neither name, one
  name, both, a duplicate, a malformed entry, a name that is no text; set again, nothing changes.
- Replacing the GPU resources keeps every other name in its place and puts the new ones last,
  as deleting them from a copy and updating it would.
- A policy that renames gpushard's resources reads asks under the new names only.
"""

import copy

import pytest

from webhook import settings
from webhook.core import asks, names, policy, rewrite

POLICY = settings.Settings().policy
ENTRIES = {names.VISIBLE_DEVICES_ENV: "3", names.FRACTION_ENV: "0.05"}

ENVS = [
    None,
    "not a list",
    [],
    [{"name": "EPOCHS", "value": "10"}],
    [{"name": "EPOCHS", "value": "10"}, {"name": names.VISIBLE_DEVICES_ENV, "value": "all"}],
    [{"name": names.FRACTION_ENV, "value": "0.05"}],
    [{"name": names.VISIBLE_DEVICES_ENV, "value": "3"}, {"name": names.FRACTION_ENV, "value": "0.05"}],
    [{"name": names.VISIBLE_DEVICES_ENV, "value": "3"}, {"name": names.VISIBLE_DEVICES_ENV, "value": "3"}],
    ["not a mapping", {"name": ["a", "list"]}, {"value": "no name"}],
]


@pytest.mark.parametrize("env", ENVS)
def test_each_env_entry_is_set_once_after_the_others(env):
    container = {"name": "train"} if env is None else {"name": "train", "env": copy.deepcopy(env)}
    for name, value in ENTRIES.items():
        rewrite.set_env(container, name, value)
    ours = tuple(ENTRIES)  # compared with ==: a name that is a list is no key to look up
    others = [e for e in (env if isinstance(env, list) else []) if not (isinstance(e, dict) and e.get("name") in ours)]
    set_here = [e for e in container["env"] if isinstance(e, dict) and e.get("name") in ours]
    assert container["env"][:len(others)] == others
    assert sorted(set_here, key=lambda e: e["name"]) == sorted(
        ({"name": n, "value": v} for n, v in ENTRIES.items()), key=lambda e: e["name"])
    assert len(container["env"]) == len(others) + len(ENTRIES)
    before = container["env"]
    for name, value in ENTRIES.items():
        rewrite.set_env(container, name, value)
    assert container["env"] is before  # already so: not even a new list


def test_gpu_resources_are_replaced_in_place_of_nothing_and_added_last():
    container = {"resources": {
        "limits": {"cpu": "4", names.FRACTION_RESOURCE: "0.05", "memory": "16Gi", "gpushard.io/card-x": "1"},
        "requests": {names.SHARES_RESOURCE: "9", "cpu": "2", "gpushard.io/card-1": "9"}}}
    wanted = {names.SHARES_RESOURCE: "5", "gpushard.io/card-3": "5"}

    rewrite._set_resources(container, POLICY, wanted)

    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    # "gpushard.io/card-x" names no card: it stays, where it was.
    assert list(limits.items()) == [("cpu", "4"), ("memory", "16Gi"), ("gpushard.io/card-x", "1"),
                                    (names.SHARES_RESOURCE, "5"), ("gpushard.io/card-3", "5")]
    assert list(requests.items()) == [("cpu", "2"), (names.SHARES_RESOURCE, "5"), ("gpushard.io/card-3", "5")]


def test_renamed_resources_are_read_under_their_new_names_only():
    renamed = policy.Policy(resources=policy.Resources(fraction="example.com/gpu", shares="example.com/shares",
                                                       card_prefix="example.com/card-", memory="example.com/mem"))
    assert renamed.resources.gpu_names == {"example.com/gpu", "example.com/shares", "example.com/mem"}

    ask = asks.read("containers", 0, {"name": "a", "resources": {
        "limits": {"example.com/gpu": "0.25"}, "requests": {"example.com/gpu": "0.25"}}}, renamed)
    assert (ask.shares, ask.holds_share) == (25, True)

    ignored = asks.read("containers", 0, {"name": "a", "resources": {
        "limits": {names.FRACTION_RESOURCE: "0.25"}, "requests": {names.FRACTION_RESOURCE: "0.25"}}}, renamed)
    assert (ignored.shares, ignored.holds_share, ignored.findings) == (0, False, [])
