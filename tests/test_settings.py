"""We test:
- the config file (docs/config.md) loads into the policy, and an absent file means the defaults;
- policy.exempt and deviceListStrategy load, default to nothing exempt and [envvar, volume-mounts];
- policy.runtimeClassName: unset, empty or null leaves pods alone; a name loads;
- every bad key or value stops the program with a message naming the key and the value;
- the replacement section (gpushard replace): defaults, values, its off switch, and cleanupRefused (off
  unless set);
- the view and agent sections (API timeouts): defaults equal to the components' own, values, and bad
  values (negative, zero, not a number, an unknown key) named with the key and the value;
- the static cluster file reads into a view, and its errors name the field.
"""

import pytest
import yaml

from webhook import settings
from webhook.cluster import static

GOOD = """\
version: v1
sharesPerCard: 100
resources: {fraction: nvidia.com/gpu, shares: gpushard.io/gpu, cardPrefix: gpushard.io/card-}
policy: {wholeCards: share, multiCard: deny, placement: binpack, hideUnrequestedGpus: true}
"""


def test_spec_example_loads(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(GOOD)
    loaded = settings.load(path)
    assert loaded.policy == settings.Settings().policy
    assert settings.load(None).policy.shares_per_card == 100


def test_other_values_load():
    s = settings.from_mapping({"sharesPerCard": 8, "policy": {"placement": "spread", "wholeCards": "passthrough",
                                                              "multiCard": "passthrough",
                                                              "hideUnrequestedGpus": False},
                               "resources": {"fraction": "example.com/gpu"}})
    p = s.policy
    assert (p.shares_per_card, p.placement, p.whole_cards, p.multi_card, p.hide_unrequested_gpus) == (
        8, "spread", "passthrough", "passthrough", False)
    assert p.resources.fraction == "example.com/gpu" and p.resources.shares == "gpushard.io/gpu"


def test_exemptions_and_device_list_strategy_load():
    defaults = settings.Settings().policy
    assert defaults.device_list_strategy == ("envvar", "volume-mounts")
    assert not defaults.exempt.service_accounts and not defaults.exempt.namespaces
    p = settings.from_mapping({"deviceListStrategy": "cdi-cri", "policy": {"exempt": {
        "serviceAccounts": ["gpu-monitoring/dcgm-exporter"], "namespaces": ["gpu-operator"]}}}).policy
    assert p.device_list_strategy == ("cdi-cri",)
    assert p.exempt.covers("gpu-monitoring", "dcgm-exporter") and p.exempt.covers("gpu-operator", "default")
    assert not p.exempt.covers("ml", "dcgm-exporter")
@pytest.mark.parametrize("value, loaded", [(None, None), ("", None), ("nvidia", "nvidia"),
                                           ("nvidia.example.com", "nvidia.example.com")])
def test_runtime_class_name(value, loaded):
    assert settings.Settings().policy.runtime_class_name is None
    assert settings.from_mapping({"policy": {"runtimeClassName": value}}).policy.runtime_class_name == loaded


@pytest.mark.parametrize("data, named", [
    ({"version": "v2"}, "version: must be 'v1', got 'v2'"),
    ({"sharesPerCard": 0}, "sharesPerCard"),
    ({"sharesPerCard": "100"}, "sharesPerCard"),
    ({"sharesPerCard": True}, "sharesPerCard"),
    ({"policy": {"placement": "random"}}, "policy.placement: must be one of binpack, spread, got 'random'"),
    ({"policy": {"nodeAffinity": "hard"}}, "policy.nodeAffinity: must be one of preferred, required, none, got "
                                           "'hard'"),
    ({"policy": {"wholeCards": "deny"}}, "policy.wholeCards"),
    ({"policy": {"multiCard": "share"}}, "policy.multiCard"),
    ({"policy": {"hideUnrequestedGpus": "yes"}}, "policy.hideUnrequestedGpus"),
    ({"policy": {"placment": "spread"}}, "policy.placment: unknown key"),
    ({"sharePerCard": 10}, "sharePerCard: unknown key"),
    ({"resources": {"shares": "gpu"}}, "resources.shares: 'gpu'"),
    ({"resources": {"fraction": "kubernetes.io/gpu"}}, "resources.fraction"),
    ({"resources": {"shares": "nvidia.com/gpu"}}, "resources: fraction, shares and cardPrefix"),
    ({"policy": ["binpack"]}, "policy: must be a mapping"),
    ({"policy": {"exempt": {"serviceAccounts": ["dcgm"]}}},
     "policy.exempt.serviceAccounts: 'dcgm' is not namespace/name"),
    ({"policy": {"exempt": {"serviceAccounts": "ns/sa"}}}, "policy.exempt.serviceAccounts: must be a list"),
    ({"policy": {"exempt": {"namespaces": ["Kube_System"]}}}, "policy.exempt.namespaces: 'Kube_System'"),
    ({"policy": {"exempt": {"users": []}}}, "policy.exempt.users: unknown key"),
    ({"policy": {"exempt": ["ns/sa"]}}, "policy.exempt: must be a mapping"),
    ({"policy": {"exempt": {"hostPaths": ["var/log"]}}}, "policy.exempt.hostPaths: 'var/log' is not an absolute path"),
    ({"policy": {"exempt": {"hostPaths": "/var/log"}}}, "policy.exempt.hostPaths: must be a list"),
    ({"deviceListStrategy": ["env"]}, "deviceListStrategy: must be one of envvar, volume-mounts, cdi-cri, got 'env'"),
    ({"deviceListStrategy": []}, "deviceListStrategy: must be a non-empty list"),
    ({"deviceListStrategy": ["envvar", "envvar"]}, "deviceListStrategy: lists a strategy twice"),
    ({"policy": {"runtimeClassName": "NVIDIA"}}, "policy.runtimeClassName: 'NVIDIA'"),
    ({"policy": {"runtimeClassName": 7}}, "policy.runtimeClassName: 7"),
    ({"replacement": {"enabled": "no"}}, "replacement.enabled: must be true or false, got 'no'"),
    ({"replacement": {"cleanupRefused": "yes"}}, "replacement.cleanupRefused: must be true or false, got 'yes'"),
    ({"replacement": {"cleanupRefused": 1}}, "replacement.cleanupRefused: must be true or false, got 1"),
    ({"replacement": {"pendingSeconds": -1}}, "replacement.pendingSeconds: must be an integer of seconds >= 0"),
    ({"replacement": {"interval": 0}}, "replacement.interval: must be an integer of seconds >= 1, got 0"),
    ({"replacement": {"interval": 1.5}}, "replacement.interval"),
    ({"replacement": {"pending": 60}}, "replacement.pending: unknown key"),
    ({"replacement": "off"}, "replacement: must be a mapping"),
    ([1, 2], "must be a mapping"),
])
def test_bad_config_names_the_key(data, named):
    with pytest.raises(settings.SettingsError) as err:
        settings.from_mapping(data)
    assert named in str(err.value)


def test_the_replacement_section():
    assert settings.from_mapping({}).replacement == settings.Replacement(True, 0, 5)
    loaded = settings.from_mapping({"replacement": {"enabled": False, "pendingSeconds": 300, "interval": 60}})
    assert loaded.replacement == settings.Replacement(False, 300, 60)
    assert not settings.from_mapping({}).replacement.cleanup_refused
    assert settings.from_mapping({"replacement": {"cleanupRefused": True}}).replacement == settings.Replacement(
        cleanup_refused=True)


def test_the_view_and_agent_timeouts():
    from webhook.kubeapi import informing

    defaults = settings.from_mapping({})
    assert (defaults.view.connect_timeout, defaults.view.list_timeout, defaults.view.watch_timeout) == (
        informing.CONNECT_TIMEOUT_S, informing.LIST_TIMEOUT_S, informing.WATCH_TIMEOUT_S)
    assert (defaults.agent.request_timeout, defaults.agent.metrics_request_timeout) == (10.0, 5.0)
    loaded = settings.from_mapping({"view": {"connectTimeout": 2.5, "listTimeout": 30, "watchTimeout": 60},
                                    "agent": {"requestTimeout": 3, "metricsRequestTimeout": 0.5}})
    assert loaded.view == settings.View(connect_timeout=2.5, list_timeout=30.0, watch_timeout=60)
    assert loaded.agent == settings.Agent(request_timeout=3.0, metrics_request_timeout=0.5)
    assert settings.from_mapping({"view": None, "agent": {}}) == defaults


@pytest.mark.parametrize("data, named", [
    ({"view": {"listTimeout": -1}}, "view.listTimeout: must be a number of seconds above 0, got -1"),
    ({"view": {"connectTimeout": 0}}, "view.connectTimeout: must be a number of seconds above 0, got 0"),
    ({"view": {"listTimeout": "2m"}}, "view.listTimeout: must be a number of seconds above 0, got '2m'"),
    ({"view": {"listTimeout": float("inf")}}, "view.listTimeout: must be a number of seconds above 0, got inf"),
    ({"view": {"connectTimeout": True}}, "view.connectTimeout: must be a number of seconds above 0, got True"),
    ({"view": {"watchTimeout": 0}}, "view.watchTimeout: must be a whole number of seconds, 1 or more, got 0"),
    ({"view": {"watchTimeout": 30.5}}, "view.watchTimeout: must be a whole number of seconds, 1 or more, got 30.5"),
    ({"view": {"watchTimeout": "300"}}, "view.watchTimeout: must be a whole number of seconds, 1 or more, got '300'"),
    ({"view": {"requestTimeout": 5}}, "view.requestTimeout: unknown key (expected one of connectTimeout, "
                                      "listTimeout, watchTimeout)"),
    ({"view": 30}, "view: must be a mapping, got 30"),
    ({"agent": {"requestTimeout": -5}}, "agent.requestTimeout: must be a number of seconds above 0, got -5"),
    ({"agent": {"requestTimeout": 0}}, "agent.requestTimeout: must be a number of seconds above 0, got 0"),
    ({"agent": {"metricsRequestTimeout": "fast"}},
     "agent.metricsRequestTimeout: must be a number of seconds above 0, got 'fast'"),
    ({"agent": {"timeout": 5}}, "agent.timeout: unknown key (expected one of metricsRequestTimeout, requestTimeout, "
                                "runtimeCDI)"),
])
def test_bad_timeouts_name_the_key_and_the_value(tmp_path, data, named):
    with pytest.raises(settings.SettingsError) as caught:
        settings.from_mapping(data)
    assert str(caught.value) == named
    # From a file, as `gpushard serve` and `gpushard agent` read it: the file's name first.
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(settings.SettingsError, match=f"^{path}: "):
        settings.load(path)


def test_bad_files_name_the_file(tmp_path):
    with pytest.raises(settings.SettingsError, match="cannot read"):
        settings.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: [v1\n")
    with pytest.raises(settings.SettingsError, match="bad.yaml: not valid YAML"):
        settings.load(bad)
    bad.write_text("policy: {placement: nowhere}\n")
    with pytest.raises(settings.SettingsError, match=r"bad.yaml: policy.placement"):
        settings.load(bad)


def test_cluster_file_reads_into_a_view(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("""\
nodes:
- name: node-a
  labels: {kubernetes.io/hostname: node-a}
  taints: [{key: nvidia.com/gpu, effect: NoSchedule}]
  cards:
  - {index: 0, uuid: GPU-aaa, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, usedShares: 40}
  - {index: 1, healthy: false}
- name: node-b
  unschedulable: true
  ready: false
""")
    view = static.load(path, 100)
    a, b = view.nodes
    assert a.cards[0].free == 60 and a.cards[0].uuid == "GPU-aaa" and a.cards[1].capacity == 0
    assert a.taints[0].key == "nvidia.com/gpu" and b.unschedulable and not b.ready


@pytest.mark.parametrize("text, named", [
    ("nodes: [{labels: {}}]", "nodes[0].name"),
    ("nodes: [{name: a, cards: [{index: -1}]}]", "nodes[0].cards[0].index"),
    ("nodes: [{name: a, cards: [{index: 0, usedShares: x}]}]", "nodes[0].cards[0].usedShares"),
    ("nodes: [{name: a, cards: [{index: 0}, {index: 0}]}]", "card indexes repeat"),
    ("nodes: [{name: a, taints: [{effect: NoSchedule}]}]", "nodes[0].taints[0]"),
    ("[1, 2]", "a list under 'nodes'"),
])
def test_bad_cluster_files_name_the_field(tmp_path, text, named):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(static.ViewFileError) as err:
        static.load(path, 100)
    assert named in str(err.value)


@pytest.mark.parametrize("name", ["example.kubernetes.io/gpu", "requests.example.com/gpu"])
def test_resource_names_the_kubelet_would_refuse_are_refused(name):
    with pytest.raises(settings.SettingsError, match="resources.shares"):
        settings.from_mapping({"resources": {"shares": name}})


def test_a_config_that_is_no_mapping_names_its_file_once(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("[1, 2]\n")
    with pytest.raises(settings.SettingsError) as err:
        settings.load(path)
    assert str(err.value).count(str(path)) == 1


def test_a_node_listed_twice_is_refused(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes: [{name: a, cards: [{index: 0}]}, {name: a, cards: [{index: 1}]}]\n")
    with pytest.raises(static.ViewFileError, match=r"nodes\[1\].name: node 'a' is listed twice"):
        static.load(path, 100)
