"""We test:
- the memory cap per card model (floored MiB of the card's own memory) and the MPS thread percentage;
- `isolation` in the config file: the three modes load, anything else names the key and value;
- enforce mode removes author-written NVIDIA_GPU_MEMORY_* and CUDA_MPS_* from GPU containers with a
  warning, leaves other containers and names alone, and a second review changes nothing;
- audit mode reports the same without changing the pod;
- with isolation on, an envFrom whose prefix could produce a limit name is denied in pods and
  templates, naming the container and the source; a safe prefix or isolation none passes.
"""

import pytest

from tests.core import podmaker
from webhook import settings
from webhook.core import decisions, isolation, names
from webhook.core import findings as f
from webhook.core.policy import Policy

H100_MIB = 81559  # NVML's figure for an H100 80GB HBM3
A10_MIB = 23028
T4_MIB = 15360


@pytest.mark.parametrize("shares, card_mib, spc, cap", [
    (25, H100_MIB, 100, 20389),  # 20389.75 floored
    (50, H100_MIB, 100, 40779),
    (100, H100_MIB, 100, H100_MIB),
    (1, H100_MIB, 100, 815),
    (25, A10_MIB, 100, 5757),
    (33, T4_MIB, 100, 5068),
    (1, T4_MIB, 1000, 15),
    (3, 16384, 8, 6144),
])
def test_memory_cap_is_the_floored_share_of_that_card(shares, card_mib, spc, cap):
    assert isolation.memory_cap_mib(shares, card_mib, spc) == cap
    # Caps of one card's containers never add up past the card.
    assert isolation.memory_cap_mib(spc - shares, card_mib, spc) + cap <= card_mib


@pytest.mark.parametrize("shares, spc, percent", [(25, 100, 25), (1, 100, 1), (100, 100, 100), (1, 1000, 1),
                                                  (3, 8, 37), (999, 1000, 99)])
def test_thread_percentage(shares, spc, percent):
    assert isolation.thread_percentage(shares, spc) == percent


@pytest.mark.parametrize("mode", ["none", "memory", "mps"])
def test_isolation_setting_loads(mode):
    assert settings.from_mapping({"isolation": mode}).policy.isolation == mode
    assert settings.from_mapping({}).policy.isolation == "none"


@pytest.mark.parametrize("value", ["MPS", "hami", "", 1, None, True])
def test_bad_isolation_names_key_and_value(value):
    with pytest.raises(settings.SettingsError) as err:
        settings.from_mapping({"isolation": value})
    assert str(err.value) == f"isolation: must be one of none, memory, mps, got {value!r}"


def decide(obj, mode=names.MODE_ENFORCE, policy=Policy()):
    return decisions.decide(decisions.Request(obj, obj["kind"], "CREATE", mode), policy, None)


def env_names(container: dict) -> list[str]:
    return [e["name"] for e in container.get("env", [])]


OWN_LIMITS = [{"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "81920"},
              {"name": "NVIDIA_GPU_MEMORY_REQUESTS", "value": "81920"},
              {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
              {"name": "BATCH", "value": "32"}]


@pytest.mark.parametrize("iso", ["none", "memory", "mps"])
def test_enforce_removes_author_limits_from_gpu_containers(iso):
    pod = podmaker.pod(podmaker.container("train", "0.25", env=list(OWN_LIMITS)),
                       podmaker.container("side", env=list(OWN_LIMITS)))
    decision = decide(pod, policy=Policy(isolation=iso))
    assert decision.allowed
    train, side = decision.obj["spec"]["containers"]
    assert env_names(train) == ["BATCH", names.VISIBLE_DEVICES_ENV, names.FRACTION_ENV]
    # A container that holds no share sees no card (void), so its variables are harmless and stay.
    assert env_names(side)[:4] == [e["name"] for e in OWN_LIMITS]
    warning = [x for x in decision.findings if x.rule == f.LIMIT_ENV_SET]
    assert [x.container for x in warning] == ["train"]
    assert warning[0].message.startswith('gpushard: container "train" sets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, '
                                         'NVIDIA_GPU_MEMORY_LIMIT, NVIDIA_GPU_MEMORY_REQUESTS; removed')
    assert all(len(w) <= decisions.WARNING_MAX for w in decision.warnings)
    assert pod["spec"]["containers"][0]["env"] == OWN_LIMITS  # the input is never changed
    again = decide(decision.obj, policy=Policy(isolation=iso))
    assert again.obj == decision.obj and not [x for x in again.findings if x.rule == f.LIMIT_ENV_SET]


def test_audit_reports_without_changing():
    pod = podmaker.pod(podmaker.container("train", "0.25", env=list(OWN_LIMITS)))
    decision = decide(pod, names.MODE_AUDIT)
    assert decision.obj is None
    assert "would remove" in next(x.message for x in decision.findings if x.rule == f.LIMIT_ENV_SET)


@pytest.mark.parametrize("prefix", [None, "", "C", "CUDA_", "CUDA_MPS_", "CUDA_MPS_X_", "NVIDIA_",
                                    "NVIDIA_GPU_MEMORY_"])
def test_env_from_that_could_write_limits_is_denied(prefix):
    source = {"secretRef": {"name": "tokens"}}
    if prefix is not None:
        source["prefix"] = prefix
    gpu = podmaker.container("train", "0.25")
    gpu["envFrom"] = [{"configMapRef": {"name": "ok"}, "prefix": "APP_"}, source]
    decision = decide(podmaker.pod(gpu), policy=Policy(isolation="mps"))
    assert not decision.allowed and decision.code == 403
    said = f'prefix "{prefix}"' if prefix else "no prefix"
    assert decision.message.startswith(f'gpushard: container "train" takes env from secret "tokens" with {said}')
    assert "give it a prefix" in decision.message
    audit = decide(podmaker.pod(gpu), names.MODE_AUDIT, Policy(isolation="memory"))
    assert audit.allowed and [x.rule for x in audit.findings if x.severity == f.DENY] == [f.LIMIT_ENV_FROM]


def test_env_from_in_a_template_is_denied_too():
    gpu = podmaker.container("serve", "0.5")
    gpu["envFrom"] = [{"configMapRef": {"name": "settings"}}]
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                  "spec": {"template": {"spec": {"containers": [gpu]}}}}
    assert not decide(deployment, policy=Policy(isolation="memory")).allowed
    assert decide(deployment, policy=Policy(isolation="none")).allowed


@pytest.mark.parametrize("prefix, allowed", [("APP_", True), ("CUDA_X", True), ("NVIDIA_GPU_X", True),
                                             ("NVIDIA_GPU_", False)])  # + "MEMORY_LIMIT" is a limit name
def test_only_prefixes_that_cannot_reach_a_limit_name_pass(prefix, allowed):
    gpu = podmaker.container("train", "0.25")
    gpu["envFrom"] = [{"configMapRef": {"name": "settings"}, "prefix": prefix}]
    assert decide(podmaker.pod(gpu), policy=Policy(isolation="mps")).allowed is allowed


def test_env_from_without_a_gpu_or_without_isolation_passes():
    plain = podmaker.container("web")
    plain["envFrom"] = [{"configMapRef": {"name": "settings"}}]
    gpu = podmaker.container("train", "0.25")
    gpu["envFrom"] = [{"configMapRef": {"name": "settings"}}]
    assert decide(podmaker.pod(plain, podmaker.container("train", "0.25")), policy=Policy(isolation="mps")).allowed
    assert decide(podmaker.pod(gpu), policy=Policy(isolation="none")).allowed
