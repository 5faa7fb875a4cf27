"""The rewrite's one-walk steps give what their step-by-step forms give.

- Setting a share-holding container's two env entries at once (rewrite._set_envs) leaves the
  same env and records the same JSONPatch as setting them one after the other (set_env), for
  every shape of env list: absent, no list, holding neither name, one name, both, a duplicate,
  a malformed entry, a name that is no text.
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
def test_two_env_entries_at_once_are_two_set_envs(env):
    container = {"name": "train"} if env is None else {"name": "train", "env": env}
    one_walk, step_by_step = copy.deepcopy(container), copy.deepcopy(container)
    ops_one, ops_steps = rewrite.Ops(), rewrite.Ops()

    rewrite._set_envs(one_walk, ENTRIES, ops_one, "/spec/containers/0")
    for name, value in ENTRIES.items():
        rewrite.set_env(step_by_step, name, value, ops_steps, "/spec/containers/0")

    assert one_walk == step_by_step
    assert ops_one.items == ops_steps.items
    assert container == ({"name": "train"} if env is None else {"name": "train", "env": env})  # input untouched


def test_gpu_resources_are_replaced_in_place_of_nothing_and_added_last():
    container = {"resources": {
        "limits": {"cpu": "4", names.FRACTION_RESOURCE: "0.05", "memory": "16Gi", "gpushard.io/card-x": "1"},
        "requests": {names.SHARES_RESOURCE: "9", "cpu": "2", "gpushard.io/card-1": "9"}}}
    wanted = {names.SHARES_RESOURCE: "5", "gpushard.io/card-3": "5"}
    ops = rewrite.Ops()

    rewrite._set_resources(container, POLICY, wanted, ops, "/spec/containers/0")

    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    # "gpushard.io/card-x" names no card: it stays, where it was.
    assert list(limits.items()) == [("cpu", "4"), ("memory", "16Gi"), ("gpushard.io/card-x", "1"),
                                    (names.SHARES_RESOURCE, "5"), ("gpushard.io/card-3", "5")]
    assert list(requests.items()) == [("cpu", "2"), (names.SHARES_RESOURCE, "5"), ("gpushard.io/card-3", "5")]
    assert [op["path"] for op in ops.items] == ["/spec/containers/0/resources/limits",
                                                "/spec/containers/0/resources/requests"]


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
