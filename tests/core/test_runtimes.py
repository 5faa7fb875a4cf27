"""We test the verdict on a node's container runtime and CDI, from the version its Node reports:
- containerd 1.6 and older, and 1.7 (CDI off by default), do not apply CDI devices; 2.0 and later do;
- any other runtime, and a version that cannot be read, is "cannot tell", and each verdict says why;
- the operator's agent.runtimeCDI true or false overrides the version, and the config refuses other words.
"""

import pytest

from webhook import settings
from webhook.core import runtimes


@pytest.mark.parametrize("version, applies", [
    ("containerd://1.6.20~ds1", False),
    ("containerd://1.5.9", False),
    ("containerd://1.7.27", False),
    ("containerd://2.0.0", True),
    ("containerd://v2.4.0-beta.0-70-g301026e58", True),
    ("cri-o://1.30.4", None),
    ("docker://27.1.0", None),
    ("fakeRuntime://0.1.0", None),
    ("", None),
    ("containerd", None),
])
def test_verdict_from_the_reported_version(version, applies):
    verdict = runtimes.cdi_support(version)
    assert verdict.applies is applies
    assert verdict.reason and (version or "unknown") in verdict.reason or not version


def test_reasons_say_what_to_do():
    assert "enable_cdi = true" in runtimes.cdi_support("containerd://1.7.2").reason
    assert "agent.runtimeCDI: true" in runtimes.cdi_support("containerd://1.7.2").reason
    assert "containerd 2.0" in runtimes.cdi_support("containerd://1.6.20").reason
    assert "agent.runtimeCDI" in runtimes.cdi_support("cri-o://1.30.0").reason


@pytest.mark.parametrize("declared, applies", [("true", True), ("false", False)])
def test_the_operators_word_wins(declared, applies):
    for version in ("containerd://1.6.20", "containerd://2.1.0", "cri-o://1.30.0", ""):
        assert runtimes.cdi_support(version, declared).applies is applies


def test_parse():
    assert runtimes.parse("containerd://1.6.20~ds1") == ("containerd", (1, 6, 20))
    assert runtimes.parse("CRI-O://1.30") == ("cri-o", (1, 30, 0))
    assert runtimes.parse("nonsense") is None


@pytest.mark.parametrize("value, stored", [(True, "true"), (False, "false"), ("auto", "auto"), ("true", "true")])
def test_config_key(value, stored):
    assert settings.from_mapping({"agent": {"runtimeCDI": value}}).agent.runtime_cdi == stored


@pytest.mark.parametrize("value", ["yes", 1, "Auto", None])
def test_config_key_refuses_other_words(value):
    with pytest.raises(settings.SettingsError, match="agent.runtimeCDI: must be auto, true or false"):
        settings.from_mapping({"agent": {"runtimeCDI": value}})
