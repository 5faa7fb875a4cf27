"""We test:
- our dra.proto against the published k8s.io/kubelet dra/v1 api.proto: package, method paths, field names and numbers;
- our pluginregistration.proto against the published pluginregistration/v1 api.proto, the same way;
- our dra_health.proto against the published dra-health/v1alpha1 api.proto: package, method path and its
  server stream, field names and numbers, the health enum;
- the committed stubs are what `make proto` makes from each today, and import their messages from the package.
"""

import pathlib
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from webhook.agent.proto import dra_health_pb2 as hpb
from webhook.agent.proto import dra_pb2 as dpb
from webhook.agent.proto import pluginregistration_pb2 as rpb

PROTO_DIR = pathlib.Path(dpb.__file__).parent

# (message, field, number, repeated) from kubernetes/kubernetes staging/src/k8s.io/kubelet/pkg/apis/dra/v1/api.proto.
DRA_FIELDS = [
    ("NodePrepareResourcesRequest", "claims", 1, True),
    ("NodePrepareResourcesResponse", "claims", 1, True),
    ("NodePrepareResourceResponse", "devices", 1, True),
    ("NodePrepareResourceResponse", "error", 2, False),
    ("Device", "request_names", 1, True),
    ("Device", "pool_name", 2, False),
    ("Device", "device_name", 3, False),
    ("Device", "cdi_device_ids", 4, True),
    ("NodeUnprepareResourcesRequest", "claims", 1, True),
    ("NodeUnprepareResourcesResponse", "claims", 1, True),
    ("NodeUnprepareResourceResponse", "error", 1, False),
    ("Claim", "namespace", 1, False),
    ("Claim", "uid", 2, False),
    ("Claim", "name", 3, False),
]

# The same from staging/src/k8s.io/kubelet/pkg/apis/pluginregistration/v1/api.proto.
REGISTRATION_FIELDS = [
    ("PluginInfo", "type", 1, False),
    ("PluginInfo", "name", 2, False),
    ("PluginInfo", "endpoint", 3, False),
    ("PluginInfo", "supported_versions", 4, True),
    ("RegistrationStatus", "plugin_registered", 1, False),
    ("RegistrationStatus", "error", 2, False),
]

# The same from staging/src/k8s.io/kubelet/pkg/apis/dra-health/v1alpha1/api.proto (Kubernetes 1.36).
HEALTH_FIELDS = [
    ("DeviceIdentifier", "pool_name", 1, False),
    ("DeviceIdentifier", "device_name", 2, False),
    ("DeviceHealth", "device", 1, False),
    ("DeviceHealth", "health", 2, False),
    ("DeviceHealth", "last_updated_time", 3, False),
    ("DeviceHealth", "health_check_timeout_seconds", 4, False),
    ("DeviceHealth", "message", 5, False),
    ("NodeWatchResourcesResponse", "devices", 1, True),
]


def test_packages_are_the_published_ones():
    # The package is part of every method path the kubelet calls.
    assert dpb.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert rpb.DESCRIPTOR.package == "pluginregistration"


@pytest.mark.parametrize("module,fields", [(dpb, DRA_FIELDS), (rpb, REGISTRATION_FIELDS)], ids=["dra", "registration"])
def test_field_numbers(module, fields):
    for message, field, number, repeated in fields:
        descriptor = module.DESCRIPTOR.message_types_by_name[message].fields_by_name[field]
        assert (message, field, descriptor.number, descriptor.is_repeated) == (message, field, number, repeated)


def test_claim_maps_are_keyed_by_string():
    entry = dpb.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"].message_type
    assert entry.GetOptions().map_entry
    assert entry.fields_by_name["key"].type == entry.fields_by_name["key"].TYPE_STRING
    assert entry.fields_by_name["value"].message_type.name == "NodePrepareResourceResponse"


def test_method_paths():
    paths = {f"/{s.full_name}/{m.name}": (m.input_type.name, m.output_type.name)
             for module in (dpb, rpb) for s in module.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert paths == {
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources": (
            "NodePrepareResourcesRequest", "NodePrepareResourcesResponse"),
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources": (
            "NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse"),
        "/pluginregistration.Registration/GetInfo": ("InfoRequest", "PluginInfo"),
        "/pluginregistration.Registration/NotifyRegistrationStatus": (
            "RegistrationStatus", "RegistrationStatusResponse"),
    }


@pytest.mark.parametrize("module", [dpb, rpb], ids=["dra", "registration"])
def test_committed_stubs_are_up_to_date(tmp_path, module):
    pytest.importorskip("grpc_tools")
    out = tmp_path / "set.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--descriptor_set_out={out}",
                    str(PROTO_DIR / module.DESCRIPTOR.name)], check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:
        for nested in (message, *message.nested_type):
            for field in nested.field:
                field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(committed)
    assert committed == fresh, f"{module.__name__} is stale: run `make proto`"


@pytest.mark.parametrize("stem", ["dra", "pluginregistration"])
def test_grpc_stubs_import_the_messages_from_the_package(stem):
    text = (PROTO_DIR / f"{stem}_pb2_grpc.py").read_text()
    assert f"\nfrom webhook.agent.proto import {stem}_pb2 as {stem}__pb2\n" in text
    assert f"\nimport {stem}_pb2" not in text


def test_health_package_method_and_stream():
    # kubelet 1.36 calls /v1alpha1.DRAResourceHealth/NodeWatchResources (api_grpc.pb.go) on every DRA plugin.
    assert hpb.DESCRIPTOR.package == "v1alpha1"
    [service] = hpb.DESCRIPTOR.services_by_name.values()
    [method] = service.methods
    assert f"/{service.full_name}/{method.name}" == "/v1alpha1.DRAResourceHealth/NodeWatchResources"
    assert (method.input_type.name, method.output_type.name) == ("NodeWatchResourcesRequest",
                                                                 "NodeWatchResourcesResponse")
    described = descriptor_pb2.FileDescriptorProto()
    hpb.DESCRIPTOR.CopyToProto(described)
    [streamed] = described.service[0].method
    assert (streamed.client_streaming, streamed.server_streaming) == (False, True)
    assert not hpb.NodeWatchResourcesRequest.DESCRIPTOR.fields


def test_health_field_numbers_and_enum():
    for message, field, number, repeated in HEALTH_FIELDS:
        descriptor = hpb.DESCRIPTOR.message_types_by_name[message].fields_by_name[field]
        assert (message, field, descriptor.number, descriptor.is_repeated) == (message, field, number, repeated)
    fields = hpb.DeviceHealth.DESCRIPTOR.fields_by_name
    assert fields["device"].message_type.name == "DeviceIdentifier"
    assert fields["health"].enum_type.name == "HealthStatus"
    assert (fields["last_updated_time"].type, fields["health_check_timeout_seconds"].type) == (
        fields["last_updated_time"].TYPE_INT64, fields["last_updated_time"].TYPE_INT64)
    assert {v.name: v.number for v in hpb.HealthStatus.DESCRIPTOR.values} == {
        "UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


def test_health_stubs_are_up_to_date_and_import_from_the_package(tmp_path):
    pytest.importorskip("grpc_tools")
    out = tmp_path / "set.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--descriptor_set_out={out}",
                    str(PROTO_DIR / "dra_health.proto")], check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto()
    hpb.DESCRIPTOR.CopyToProto(committed)
    assert committed == fresh, "dra_health_pb2 is stale: run `make proto`"
    text = (PROTO_DIR / "dra_health_pb2_grpc.py").read_text()
    assert "\nfrom webhook.agent.proto import dra_health_pb2 as dra__health__pb2\n" in text
