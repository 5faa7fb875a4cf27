"""We test:
- our deviceplugin.proto against the kubelet's wire facts: package, services, method paths, field names and numbers;
- our podresources.proto against the published PodResources v1 facts, the same way;
- the committed stubs are what `make proto` makes from each today.
"""

import pathlib
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from webhook.agent.proto import deviceplugin_pb2 as pb
from webhook.agent.proto import podresources_pb2 as prpb

PROTO_DIR = pathlib.Path(pb.__file__).parent

# (message, field, number, repeated) from the published v1beta1 api.proto.
FIELDS = [
    ("DevicePluginOptions", "pre_start_required", 1, False),
    ("DevicePluginOptions", "get_preferred_allocation_available", 2, False),
    ("RegisterRequest", "version", 1, False),
    ("RegisterRequest", "endpoint", 2, False),
    ("RegisterRequest", "resource_name", 3, False),
    ("RegisterRequest", "options", 4, False),
    ("ListAndWatchResponse", "devices", 1, True),
    ("TopologyInfo", "nodes", 1, True),
    ("NUMANode", "ID", 1, False),
    ("Device", "ID", 1, False),
    ("Device", "health", 2, False),
    ("Device", "topology", 3, False),
    ("PreStartContainerRequest", "devices_ids", 1, True),
    ("PreferredAllocationRequest", "container_requests", 1, True),
    ("ContainerPreferredAllocationRequest", "available_deviceIDs", 1, True),
    ("ContainerPreferredAllocationRequest", "must_include_deviceIDs", 2, True),
    ("ContainerPreferredAllocationRequest", "allocation_size", 3, False),
    ("PreferredAllocationResponse", "container_responses", 1, True),
    ("ContainerPreferredAllocationResponse", "deviceIDs", 1, True),
    ("AllocateRequest", "container_requests", 1, True),
    ("ContainerAllocateRequest", "devices_ids", 1, True),
    ("CDIDevice", "name", 1, False),
    ("AllocateResponse", "container_responses", 1, True),
    ("ContainerAllocateResponse", "envs", 1, True),
    ("ContainerAllocateResponse", "mounts", 2, True),
    ("ContainerAllocateResponse", "devices", 3, True),
    ("ContainerAllocateResponse", "annotations", 4, True),
    ("ContainerAllocateResponse", "cdi_devices", 5, True),
    ("Mount", "container_path", 1, False),
    ("Mount", "host_path", 2, False),
    ("Mount", "read_only", 3, False),
    ("DeviceSpec", "container_path", 1, False),
    ("DeviceSpec", "host_path", 2, False),
    ("DeviceSpec", "permissions", 3, False),
]


def test_package_and_messages():
    assert pb.DESCRIPTOR.package == "v1beta1"
    messages = set(pb.DESCRIPTOR.message_types_by_name)
    assert messages == {m for m, *_ in FIELDS} | {"Empty", "PreStartContainerResponse"}
    assert not pb.Empty.DESCRIPTOR.fields and not pb.PreStartContainerResponse.DESCRIPTOR.fields


@pytest.mark.parametrize("message,field,number,repeated", FIELDS)
def test_field_numbers_match_the_kubelet(message, field, number, repeated):
    descriptor = pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[field]
    assert descriptor.number == number
    assert descriptor.is_repeated == repeated


def test_services_and_method_paths():
    paths = {f"/{s.full_name}/{m.name}": (m.input_type.name, m.output_type.name, m.server_streaming)
             for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert paths == {
        "/v1beta1.Registration/Register": ("RegisterRequest", "Empty", False),
        "/v1beta1.DevicePlugin/GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "/v1beta1.DevicePlugin/ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "/v1beta1.DevicePlugin/GetPreferredAllocation": ("PreferredAllocationRequest",
                                                         "PreferredAllocationResponse", False),
        "/v1beta1.DevicePlugin/Allocate": ("AllocateRequest", "AllocateResponse", False),
        "/v1beta1.DevicePlugin/PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    }


def test_envs_are_a_string_map():
    response = pb.ContainerAllocateResponse(envs={"A": "1"})
    assert pb.ContainerAllocateResponse.FromString(response.SerializeToString()).envs["A"] == "1"


# (message, field, number, repeated) from the published k8s.io/kubelet/pkg/apis/podresources/v1 api.proto.
POD_RESOURCES_FIELDS = [
    ("AllocatableResourcesResponse", "devices", 1, True),
    ("AllocatableResourcesResponse", "cpu_ids", 2, True),
    ("AllocatableResourcesResponse", "memory", 3, True),
    ("ListPodResourcesResponse", "pod_resources", 1, True),
    ("PodResources", "name", 1, False),
    ("PodResources", "namespace", 2, False),
    ("PodResources", "containers", 3, True),
    ("ContainerResources", "name", 1, False),
    ("ContainerResources", "devices", 2, True),
    ("ContainerResources", "cpu_ids", 3, True),
    ("ContainerResources", "memory", 4, True),
    ("ContainerMemory", "memory_type", 1, False),
    ("ContainerMemory", "size", 2, False),
    ("ContainerMemory", "topology", 3, False),
    ("ContainerDevices", "resource_name", 1, False),
    ("ContainerDevices", "device_ids", 2, True),
    ("ContainerDevices", "topology", 3, False),
    ("TopologyInfo", "nodes", 1, True),
    ("NUMANode", "ID", 1, False),
]


def test_pod_resources_package_and_messages():
    assert prpb.DESCRIPTOR.package == "v1"
    messages = set(prpb.DESCRIPTOR.message_types_by_name)
    assert messages == {m for m, *_ in POD_RESOURCES_FIELDS} | {"ListPodResourcesRequest",
                                                                 "AllocatableResourcesRequest"}


@pytest.mark.parametrize("message,field,number,repeated", POD_RESOURCES_FIELDS)
def test_pod_resources_field_numbers(message, field, number, repeated):
    descriptor = prpb.DESCRIPTOR.message_types_by_name[message].fields_by_name[field]
    assert descriptor.number == number
    assert descriptor.is_repeated == repeated


def test_pod_resources_method_paths():
    paths = {f"/{s.full_name}/{m.name}": (m.input_type.name, m.output_type.name, m.server_streaming)
             for s in prpb.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert paths == {
        "/v1.PodResourcesLister/List": ("ListPodResourcesRequest", "ListPodResourcesResponse", False),
        "/v1.PodResourcesLister/GetAllocatableResources": ("AllocatableResourcesRequest",
                                                           "AllocatableResourcesResponse", False),
    }


@pytest.mark.parametrize("module", [pb, prpb], ids=["deviceplugin", "podresources"])
def test_committed_stubs_are_up_to_date(tmp_path, module):
    # Compare descriptors, not text: a newer protoc writes other version lines for the same schema.
    pytest.importorskip("grpc_tools")
    out = tmp_path / "set.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--descriptor_set_out={out}",
                    str(PROTO_DIR / module.DESCRIPTOR.name)], check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    # protoc fills in json_name; the embedded descriptor leaves it to the runtime.
    for message in fresh.message_type:
        for nested in (message, *message.nested_type):
            for field in nested.field:
                field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(committed)
    assert committed == fresh, f"{module.__name__} is stale: run `make proto`"


@pytest.mark.parametrize("stem,paths", [
    ("deviceplugin", ("/v1beta1.Registration/Register", "/v1beta1.DevicePlugin/ListAndWatch",
                      "/v1beta1.DevicePlugin/Allocate")),
    ("podresources", ("/v1.PodResourcesLister/List", "/v1.PodResourcesLister/GetAllocatableResources")),
])
def test_grpc_stubs_import_the_messages_from_the_package(stem, paths):
    text = (PROTO_DIR / f"{stem}_pb2_grpc.py").read_text()
    assert f"\nfrom webhook.agent.proto import {stem}_pb2 as {stem}__pb2\n" in text
    assert f"\nimport {stem}_pb2" not in text
    for path in paths:
        assert f"'{path}'" in text
