"""We test the config's backend key: deviceplugin by default, dra when asked, anything else refused by name."""

import pytest

from webhook import settings
from webhook.core import policy as policy_mod


def test_default_is_the_device_plugin():
    assert settings.from_mapping({}).policy.backend == policy_mod.DEVICEPLUGIN


def test_dra_is_selectable():
    assert settings.from_mapping({"backend": "dra"}).policy.backend == policy_mod.DRA


@pytest.mark.parametrize("value", ["DRA", "device-plugin", None, 1, ["dra"]])
def test_anything_else_is_refused_naming_the_key_and_value(value):
    with pytest.raises(settings.SettingsError) as caught:
        settings.from_mapping({"backend": value})
    assert str(caught.value) == f"backend: must be one of deviceplugin, dra, got {value!r}"


def test_a_bad_file_names_itself(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\nbackend: dynamic\n")
    with pytest.raises(settings.SettingsError) as caught:
        settings.load(path)
    assert str(caught.value) == f"{path}: backend: must be one of deviceplugin, dra, got 'dynamic'"
