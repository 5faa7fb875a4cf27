"""We test:
- reading a fake inventory file (YAML and JSON), and errors that name the bad entry;
- the fake backend: injected events, a timeout with none, and health played by editing the file;
- usage: the fake backend reports idle cards, then what a test sets, and nothing for a removed card;
- the null backend;
- choosing a backend: the fake file wins, and without NVML a clear error (or nothing, if allowed);
- real NVML discovery (marked gpu; skipped where NVML cannot load).
"""

import json
import os
import time

import pytest

from webhook.agent.node import nvml

INVENTORY = """
cards:
- {index: 0, uuid: GPU-aaaa, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}
- {index: 1, uuid: GPU-bbbb, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}
"""


def nvml_loads() -> bool:
    try:
        nvml.NvmlDevices().close()
    except nvml.NvmlUnavailable:
        return False
    return True


def write(path, text):
    path.write_text(text)
    # Some filesystems keep mtimes coarse; a new size or mtime is what the fake looks at.
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_inventory_yaml_gives_cards_in_index_order(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    devices = nvml.FakeDevices.from_file(path)
    assert devices.cards() == [nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559),
                               nvml.Card(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3", 81559)]
    assert devices.wait_event(0.05) is None


def test_inventory_json_bare_list(tmp_path):
    path = tmp_path / "inv.json"
    path.write_text(json.dumps([{"index": 3, "uuid": "GPU-x", "model": "T4", "memoryMiB": 15360}]))
    assert nvml.FakeDevices.from_file(path).cards() == [nvml.Card(3, "GPU-x", "T4", 15360)]


@pytest.mark.parametrize("text,fragment", [
    ("cards: [{index: -1, uuid: GPU-a}]", "cards[0].index"),
    ("cards: [{index: 0}]", "cards[0].uuid"),
    ("cards: [{index: 0, uuid: GPU-a, memoryMiB: lots}]", "cards[0].memoryMiB"),
    ("cards: [{index: 0, uuid: GPU-a, colour: green}]", "cards[0].colour"),
    ("cards: [{index: 0, uuid: GPU-a}, {index: 0, uuid: GPU-b}]", "cards[1]"),
    ("gpus: []", "gpus"),
    ("cards: 3", "cards must be a list"),
    ("cards: [", "not valid YAML"),
])
def test_bad_inventory_names_the_entry(tmp_path, text, fragment):
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    with pytest.raises(nvml.InventoryError) as err:
        nvml.FakeDevices.from_file(path)
    assert fragment in str(err.value)
    assert str(path) in str(err.value)


def test_missing_inventory_file(tmp_path):
    with pytest.raises(nvml.InventoryError, match="cannot read"):
        nvml.load_inventory(tmp_path / "nope.yaml")


def test_injected_events_come_out_in_order():
    devices = nvml.FakeDevices([nvml.Card(0, "GPU-a", "m", 1)])
    first = nvml.HealthEvent("GPU-a", healthy=False, reason="Xid 79")
    second = nvml.HealthEvent("GPU-a", healthy=True)
    devices.inject(first)
    devices.inject(second)
    assert devices.wait_event(1) == first
    assert devices.wait_event(1) == second
    started = time.monotonic()
    assert devices.wait_event(0.1) is None
    assert time.monotonic() - started < 1


def test_editing_the_file_plays_health_changes(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    devices = nvml.FakeDevices.from_file(path, poll=0.02)
    write(path, INVENTORY.replace("memoryMiB: 81559}\n- {index: 1", "memoryMiB: 81559, healthy: false}\n- {index: 1"))
    event = devices.wait_event(2)
    assert (event.uuid, event.healthy, event.present) == ("GPU-aaaa", False, True)
    # Card 1 leaves the file and card 0 is healthy again.
    write(path, "cards:\n- {index: 0, uuid: GPU-aaaa, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}\n")
    events = {e.uuid: e for e in (devices.wait_event(2), devices.wait_event(2))}
    assert (events["GPU-aaaa"].healthy, events["GPU-aaaa"].present) == (True, True)
    assert (events["GPU-bbbb"].healthy, events["GPU-bbbb"].present) == (False, False)
    # A broken edit keeps the last good state; no event.
    write(path, "cards: [")
    assert devices.wait_event(0.2) is None
    # Cards added later are not picked up.
    write(path, INVENTORY + "- {index: 2, uuid: GPU-cccc}\n")
    event = devices.wait_event(2)
    assert (event.uuid, event.healthy, event.present) == ("GPU-bbbb", True, True)
    assert devices.wait_event(0.1) is None
    assert [c.index for c in devices.cards()] == [0, 1]


def test_a_card_unhealthy_in_the_file_from_the_start_is_reported(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text("cards: [{index: 0, uuid: GPU-a, healthy: false}]")
    devices = nvml.FakeDevices.from_file(path)
    event = devices.wait_event(1)
    assert (event.uuid, event.healthy) == ("GPU-a", False)


def test_fake_usage_is_idle_until_set_and_a_removed_card_gives_none(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    devices = nvml.FakeDevices.from_file(path, poll=0.02)
    assert devices.usage()["GPU-aaaa"] == nvml.Usage(0, 81559 * nvml.MIB, 0)
    busy = nvml.Usage(3 << 30, 81559 * nvml.MIB, 55, (nvml.Process(77, 3 << 30),), xid_errors=1)
    devices.set_usage("GPU-bbbb", busy)
    assert devices.usage()["GPU-bbbb"] == busy
    with pytest.raises(KeyError, match="GPU-cccc"):
        devices.set_usage("GPU-cccc", busy)
    path.write_text("cards:\n- {index: 0, uuid: GPU-aaaa, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}\n")
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)
    assert devices.wait_event(2).uuid == "GPU-bbbb"
    assert set(devices.usage()) == {"GPU-aaaa"}


def test_null_backend_has_nothing():
    devices = nvml.NullDevices()
    assert devices.cards() == []
    assert devices.usage() == {}
    assert devices.wait_event(0.01) is None
    devices.close()


def test_the_fake_inventory_wins_over_nvml(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    assert isinstance(nvml.open_devices(path), nvml.FakeDevices)


def test_without_nvml_opening_fails_clearly_unless_allowed():
    if nvml_loads():
        pytest.skip("NVML loads on this machine")
    with pytest.raises(nvml.NvmlUnavailable):
        nvml.open_devices()
    assert isinstance(nvml.open_devices(allow_no_gpus=True), nvml.NullDevices)


@pytest.mark.gpu
def test_real_nvml_discovery():
    try:
        devices = nvml.NvmlDevices(probe_interval=0.1)
    except nvml.NvmlUnavailable as exc:
        pytest.skip(f"NVML cannot load here: {exc}")
    try:
        cards = devices.cards()
        assert cards, "NVML loaded but found no cards"
        assert [c.index for c in cards] == list(range(len(cards)))
        for card in cards:
            assert card.uuid.startswith(("GPU-", "MIG-")), card
            assert card.model
            assert card.memory_mib > 0
        assert len({c.uuid for c in cards}) == len(cards)
        # A healthy machine reports no change while the event set and the probe run.
        assert devices.wait_event(0.5) is None
    finally:
        devices.close()


@pytest.mark.parametrize("xid,critical", [(13, False), (31, False), (43, False), (45, False), (68, False),
                                          (109, False), (48, True), (63, True), (74, True), (79, True)])
def test_application_xids_are_not_critical(xid, critical):
    assert nvml.is_critical_xid(xid) is critical
