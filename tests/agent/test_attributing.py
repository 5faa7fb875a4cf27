"""We test how a GPU process is tied to its container, and the container to its names and shares:
- cgroup paths of every layout in use (cgroupfs and systemd drivers, cgroup v1 and v2, containerd,
  CRI-O and Docker, containerd's "slice:runtime:id" notation, a private cgroup namespace, guaranteed
  pods, static pods' 32-digit UIDs), CRI-O's conmon and non-pod processes;
- /proc/<pid>/cgroup files with several lines: the unified line wins; a missing process is None;
- the node's pods from the API: index by container ID (with the previous ID of a restarted container),
  listing again for an unknown ID at most once per interval, and when the list is stale; an API error
  keeps the last index;
- PodResources: only the per-card resource counts (the node-wide resource's IDs may name another card),
  through the stand-in server on a unix socket; an absent socket is a PodResourcesError.
"""

from __future__ import annotations

import os

import pytest

from tests.agent import fakekubelet, fakenode, fakepodresources
from tests.fakekube import FakeKube
from webhook.agent.metrics import attributing, podlisting
from webhook.agent.node import podresources
from webhook.agent.proto import podresources_pb2 as pb
from webhook.core import policy as policy_mod

UID = "1f2e3d4c-0000-4111-8222-123456789abc"
SD = UID.replace("-", "_")
CID = "ab" * 32


@pytest.mark.parametrize("path,expected", [
    (f"/kubepods/burstable/pod{UID}/{CID}", (UID, CID)),
    (f"/kubepods/pod{UID}/{CID}", (UID, CID)),
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SD}.slice/cri-containerd-{CID}.scope",
     (UID, CID)),
    (f"/kubepods.slice/kubepods-pod{SD}.slice/crio-{CID}.scope", (UID, CID)),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SD}.slice/docker-{CID}.scope", (UID, CID)),
    (f"/system.slice/containerd.service/kubepods-besteffort-pod{SD}.slice:cri-containerd:{CID}", (UID, CID)),
    (f"/../../kubepods-burstable-pod{SD}.slice/cri-containerd-{CID}.scope/init.scope", (UID, CID)),
    (f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{SD}.slice/cri-containerd-{CID}.scope", (UID, CID)),
    (f"/kubepods/besteffort/pod{'c' * 32}/{CID}", ("c" * 32, CID)),
    (f"/kubepods/burstable/pod{UID}", (UID, None)),
    (f"/kubepods.slice/kubepods-pod{SD}.slice/crio-conmon-{CID}.scope", None),
    ("/system.slice/containerd.service", None),
    ("/user.slice/user-1000.slice/session-3.scope", None),
    ("/", None),
])
def test_cgroup_paths(path, expected):
    ref = attributing.parse_cgroup_path(path)
    assert (None if ref is None else (ref.pod_uid, ref.container_id)) == expected


def test_cgroup_files_and_missing_processes(tmp_path):
    v1 = f"12:memory:/kubepods/burstable/pod{UID}/{CID}\n1:name=systemd:/\n"
    assert attributing.parse_cgroup_file(v1) == attributing.ContainerRef(UID, CID)
    hybrid = f"5:cpu:/kubepods/pod{UID}\n0::/kubepods/pod{UID}/{'cd' * 32}\n"
    assert attributing.parse_cgroup_file(hybrid).container_id == "cd" * 32
    assert attributing.parse_cgroup_file("0::/init.scope\n") is None
    assert attributing.parse_cgroup_file("garbage") is None
    node = fakenode.FakeNode(str(tmp_path), None)
    node.write_proc(42, v1)
    reader = attributing.ProcReader(str(tmp_path))
    assert reader.container_of(42) == attributing.ContainerRef(UID, CID)
    assert reader.container_of(43) is None


def test_node_pods_index_and_relist(tmp_path):
    clock = [1000.0]
    pod = fakenode.Pod("ml", "train", [fakenode.Container("trainer", 0, 10, restarts=2)])
    with FakeKube() as kube:
        kube.put("pods", pod.api_object("node-a"))
        kube.put("pods", fakenode.Pod("ml", "away", [fakenode.Container("x")]).api_object("node-b"))
        pods = podlisting.NodePods(kube.api_client(), "node-a", min_interval=5, max_age=60, clock=lambda: clock[0])
        current, previous = pod.containers[0].cid(pod), fakenode.container_id("ml", "train", "trainer", "1")
        expected = podlisting.ContainerName("ml", "train", "trainer")
        assert pods.container(current) == expected
        assert pods.container(previous) == expected
        assert pods.pod(pod.uid) == podlisting.PodName("ml", "train", ("trainer",))
        assert pods.lists == 1
        lists = [p for m, p, _ in kube.requests if m == "GET" and "/pods" in p]
        assert len(lists) == 1 and "fieldSelector=spec.nodeName%3Dnode-a" in lists[0]
        # The other node's pod is not listed, and an unknown ID relists at most once per interval.
        assert pods.container(fakenode.Pod("ml", "away", []).uid) is None
        assert pods.container("f" * 64) is None
        assert pods.lists == 1
        clock[0] += 5
        assert pods.container("f" * 64) is None
        assert pods.lists == 2
        # A known ID does not relist until the list is stale.
        clock[0] += 30
        pods.container(current)
        assert pods.lists == 2
        clock[0] += 30
        kube.fail_next = [500]
        assert pods.container(current) == expected  # the API failed: the last index stays
        assert (pods.lists, pods.errors) == (3, 1)


def test_pod_resources_holdings_over_the_socket():
    folder = fakekubelet.short_tempdir("gpr-")
    server = fakepodresources.FakePodResources(os.path.join(folder, "kubelet.sock")).start()
    client = podresources.Client(server.path, timeout=2)
    try:
        server.set([
            # The node-wide resource's IDs name card 1, the per-card resource says card 0: card 0 it is.
            pb.PodResources(namespace="ml", name="train", containers=[
                fakepodresources.gpu_container("trainer", 0, 0, 25, aggregate_card=1),
                pb.ContainerResources(name="sidecar"),
                pb.ContainerResources(name="cpu-pinned", cpu_ids=[3, 4]),
            ]),
            pb.PodResources(namespace="lab", name="other", containers=[
                fakepodresources.container("nv", **{"nvidia.com/gpu": ["GPU-1"]}),
                # An ID of another card under card-1's name is not a share of card 1.
                pb.ContainerResources(name="odd", devices=[pb.ContainerDevices(
                    resource_name="gpushard.io/card-1", device_ids=["card-1-0", "card-0-5", "bogus"])]),
            ]),
        ])
        assert client.holdings(policy_mod.Policy()) == [
            podresources.Holding("ml", "train", "trainer", 0, 25),
            podresources.Holding("lab", "other", "odd", 1, 1),
        ]
    finally:
        client.close()
        server.stop()
        fakekubelet.remove_tree(folder)
    absent = podresources.Client(os.path.join(folder, "kubelet.sock"), timeout=0.5)
    with pytest.raises(podresources.PodResourcesError, match="kubelet.sock"):
        absent.holdings(policy_mod.Policy())
    absent.close()
