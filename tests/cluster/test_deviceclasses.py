"""The webhook's view of DeviceClasses over a real HTTP API server (tests/fakekube.py), and a cluster file's.

We test:
- the live view lists the classes with the typed client's list call, then watches them: a class added,
  changed, or deleted changes what ``served()`` says, gpushard's own class and classes naming no
  extendedResourceName serve nothing, and an unreadable class in an event is skipped without stopping
  the watch;
- what ``served()`` returns cannot be changed, and is replaced, never mutated, when classes change;
- an API server without resource.k8s.io/v1 gives an empty view that is still synced, and the classes
  once it serves them;
- a cluster file's optional ``deviceClasses`` serve what they say; a bad entry is a one-line error naming
  the field and the value; a file without them serves nothing;
- `gpushard review --cluster FILE` judges pods by the file's classes: a denial naming the class, a warning.
"""

from __future__ import annotations

import pytest

from tests.cluster import kubeobjects as o
from webhook import cli
from webhook.cluster import deviceclasses, static
from webhook.core import extended


def device_class(name: str, resource: str | None = None, driver: str | None = None) -> dict:
    spec: dict = {}
    if resource is not None:
        spec["extendedResourceName"] = resource
    if driver is not None:
        spec["selectors"] = [{"cel": {"expression": f'device.driver == "{driver}"'}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}


@pytest.fixture
def start(fake):
    opened = []

    def start_classes():
        classes = deviceclasses.DeviceClasses.start(api_client=fake.api_client(), watch_timeout=5,
                                                    backoff=(0.05, 0.3))
        opened.append(classes)
        return classes

    yield start_classes
    for classes in opened:
        classes.close()


def test_the_live_view_lists_then_follows_the_classes(fake, start):
    fake.put("deviceclasses", device_class("gpu.nvidia.com", "nvidia.com/gpu", "gpu.nvidia.com"))
    fake.put("deviceclasses", device_class("gpu.gpushard.io", "gpushard.io/gpu", "gpu.gpushard.io"))
    fake.put("deviceclasses", device_class("plain.example.com", driver="plain.example.com"))
    classes = start()
    o.wait_for(classes.synced, what="the first list")
    assert dict(classes.served()) == {"nvidia.com/gpu": extended.Served("gpu.nvidia.com", "gpu.nvidia.com")}
    assert any("/apis/resource.k8s.io/v1/deviceclasses" in path for _m, path, _b in fake.requests)
    o.wait_for(lambda: classes.informer.watches["deviceclasses"] >= 1, what="the watch")

    listed = classes.served()
    fake.put("deviceclasses", device_class("gpu.example.com", "gpushard.io/card-0"))
    o.wait_for(lambda: "gpushard.io/card-0" in classes.served(), what="the added class")
    assert "gpushard.io/card-0" not in listed  # replaced, never changed under a reader
    with pytest.raises(TypeError):
        classes.served()["x"] = extended.Served("x")

    fake.put("deviceclasses", device_class("gpu.example.com", "gpushard.io/gpu"))
    o.wait_for(lambda: "gpushard.io/gpu" in classes.served(), what="the changed class")
    assert "gpushard.io/card-0" not in classes.served()
    fake.put("deviceclasses", device_class("gpu.nvidia.com"))  # its extendedResourceName removed
    o.wait_for(lambda: "nvidia.com/gpu" not in classes.served(), what="the name no longer served")
    fake.put("deviceclasses", {"metadata": {"name": "odd"}, "spec": "not a mapping"})
    fake.delete("deviceclasses", "gpu.example.com")
    o.wait_for(lambda: classes.served() == {}, what="the deleted class")
    assert classes.served() is extended.NONE


def test_an_api_server_without_resource_k8s_io_serves_nothing_until_it_does(fake, start):
    fake.unserved.add("resource.k8s.io/v1")
    classes = start()
    o.wait_for(classes.synced, what="the empty list")
    assert classes.served() == {}
    fake.unserved.clear()
    fake.put("deviceclasses", device_class("gpu.nvidia.com", "nvidia.com/gpu"))
    o.wait_for(lambda: "nvidia.com/gpu" in classes.served(), what="the class after an upgrade")


def test_without_an_api_client_nothing_is_served():
    classes = deviceclasses.DeviceClasses(None)
    classes.informer.start()
    assert classes.served() == {} and not classes.informer.threads
    classes.close()


def _file(tmp_path, text: str):
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes:\n- name: a\n  cards: [{index: 0}]\n" + text)
    return path


def test_a_cluster_files_device_classes(tmp_path):
    path = _file(tmp_path, "deviceClasses:\n"
                           "- {name: gpu.nvidia.com, extendedResourceName: nvidia.com/gpu, driver: gpu.nvidia.com}\n"
                           "- {name: card.example.com, extendedResourceName: gpushard.io/card-1}\n"
                           "- {name: gpu.gpushard.io, extendedResourceName: example.com/ours}\n")
    view, served = static.load_file(path, 100)
    assert [n.name for n in view.nodes] == ["a"]
    assert dict(served) == {"nvidia.com/gpu": extended.Served("gpu.nvidia.com", "gpu.nvidia.com"),
                            "gpushard.io/card-1": extended.Served("card.example.com")}
    assert static.load_file(_file(tmp_path, ""), 100)[1] is extended.NONE
    assert deviceclasses.Fixed(served).served() == served


@pytest.mark.parametrize("text, said", [
    ("deviceClasses: {name: x}\n", "deviceClasses: must be a list, got {'name': 'x'}"),
    ("deviceClasses: [gpu.nvidia.com]\n",
     "deviceClasses[0]: must be a mapping with name and extendedResourceName, got 'gpu.nvidia.com'"),
    ("deviceClasses: [{extendedResourceName: nvidia.com/gpu}]\n",
     "deviceClasses[0].name: every DeviceClass needs a name, got None"),
    ("deviceClasses: [{name: a, extendedResourceName: a.io/x}, {name: a, extendedResourceName: a.io/y}]\n",
     "deviceClasses[1].name: DeviceClass 'a' is listed twice"),
    ("deviceClasses: [{name: a}]\n", "deviceClasses[0].extendedResourceName: must be an extended resource name "
                                     "such as example.com/gpu, got None"),
    ("deviceClasses: [{name: a, extendedResourceName: gpu}]\n", "deviceClasses[0].extendedResourceName: must be "
     "an extended resource name such as example.com/gpu (a domain, not kubernetes.io, then a name), got 'gpu'"),
    ("deviceClasses: [{name: a, extendedResourceName: example.kubernetes.io/gpu}]\n",
     "got 'example.kubernetes.io/gpu'"),
    ("deviceClasses: [{name: a, extendedResourceName: Example.com/gpu}]\n",
     "(a lowercase DNS domain, then a name of at most 63 letters, digits, '-', '_' or '.'), got 'Example.com/gpu'"),
    ("deviceClasses: [{name: a, extendedResourceName: example.com/-gpu}]\n", "got 'example.com/-gpu'"),
    ("deviceClasses: [{name: a, extendedResourceName: a.io/b, driver: 5}]\n",
     "deviceClasses[0].driver: must be a driver name such as gpu.nvidia.com (a lowercase DNS name of at most 63 "
     "characters), got 5"),
    ("deviceClasses: [{name: a, extendedResourceName: a.io/b, driver: 'gpu\" || true'}]\n", "got 'gpu\" || true'"),
])
def test_a_bad_device_class_entry_names_the_field_and_the_value(tmp_path, text, said):
    with pytest.raises(static.ViewFileError) as err:
        static.load(_file(tmp_path, text), 100)
    assert said in str(err.value)
    assert "\n" not in str(err.value)


def test_review_judges_pods_by_the_cluster_files_classes(tmp_path, capsys):
    pod = tmp_path / "pod.yaml"
    pod.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: train, namespace: ml}\nspec:\n  containers:\n"
                   "  - name: t\n    resources: {limits: {nvidia.com/gpu: '0.25'}}\n")
    shared = _file(tmp_path, "deviceClasses: [{name: gpu.nvidia.com, extendedResourceName: nvidia.com/gpu}]\n")
    assert cli.main(["review", str(pod), "--cluster", str(shared)]) == 0
    out = capsys.readouterr().out
    assert ("# warning: gpushard: DeviceClass gpu.nvidia.com serves nvidia.com/gpu too; the fraction became "
            "gpushard.io/gpu shares") in out
    taken = _file(tmp_path, "deviceClasses: [{name: gpu.example.com, extendedResourceName: gpushard.io/gpu, "
                            "driver: gpu.example.com}]\n")
    assert cli.main(["review", str(pod), "--cluster", str(taken)]) == 1
    out = capsys.readouterr().out
    assert "denied (403): gpushard: DeviceClass gpu.example.com has spec.extendedResourceName gpushard.io/gpu" in out
    bad = _file(tmp_path, "deviceClasses: [{name: x, extendedResourceName: gpu}]\n")
    assert cli.main(["review", str(pod), "--cluster", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpushard: bad cluster file: {bad}: deviceClasses[0].extendedResourceName: ")
