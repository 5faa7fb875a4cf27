"""We test:
- `gpushard review` prints each manifest as admitted, with its card, or its denial, and exits 1 on a denial;
  what a memory ask became is a note and the pod's annotations, not a warning;
- the namespace's mode: a Namespace among the files decides for its objects (no label: nothing
  rewritten and the output says so; gpushard.io resources there are denied as the opt-in policy
  does; audit: unchanged), `--mode none` for the rest;
- placements in one review run count against the view, as in the webhook, so pods pack;
- unreadable files exit 2 with a message naming the file; a bad config stops before any work (exit 2);
- `make demo`'s script runs end to end against the real server and shows rewrites and denials.
"""

import io
import pathlib
import subprocess
import sys

import yaml

from webhook import cli, reviewing, settings
from webhook.cluster import static

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def review(*paths, mode="enforce"):
    out = io.StringIO()
    view = static.StaticView(static.load(EXAMPLES / "cluster.yaml", 100))
    code = reviewing.review_files([str(p) for p in paths], settings.Settings(), view, mode, out)
    return code, out.getvalue()


def test_review_prints_admitted_objects_and_denials():
    code, text = review(*sorted((EXAMPLES / "demo").glob("*.yaml")))
    assert code == 1
    assert "Pod research/notebook" in text and "admitted: 25 shares of card 0 on node gpu-node-a" in text
    assert "denied (403): gpushard: container \"train\" asks nvidia.com/gpu 1.5" in text
    docs = [d for d in yaml.safe_load_all(text) if d]
    notebook = next(d for d in docs if d["metadata"]["name"] == "notebook")
    assert notebook["metadata"]["annotations"]["gpushard.io/card"] == "0"


def test_review_notes_what_a_memory_ask_became_without_a_warning():
    code, text = review(EXAMPLES / "demo/11-memory-ask.yaml")
    assert code == 0 and "# warning:" not in text
    assert "# note: gpushard: the pod asks 12288 MiB of GPU memory: 54 shares of card 0" in text
    (pod,) = [d for d in yaml.safe_load_all(text) if d]
    annotations = pod["metadata"]["annotations"]
    assert (annotations["gpushard.io/memory-mib"], annotations["gpushard.io/card-memory-mib"]) == ("12288", "23034")


NAMESPACES = """\
apiVersion: v1
kind: Namespace
metadata: {name: web}
---
apiVersion: v1
kind: Namespace
metadata: {name: lab, labels: {gpushard.io/mode: audit}}
---
apiVersion: v1
kind: Pod
metadata: {name: site, namespace: web}
spec:
  containers: [{name: nginx, image: nginx}]
---
apiVersion: v1
kind: Pod
metadata: {name: grab, namespace: web}
spec:
  containers:
  - {name: train, image: cuda, resources: {limits: {gpushard.io/card-1: 10}}}
---
apiVersion: v1
kind: Pod
metadata: {name: quarter, namespace: lab}
spec:
  containers:
  - {name: train, image: cuda, resources: {limits: {nvidia.com/gpu: "0.25"}}}
---
apiVersion: v1
kind: Pod
metadata: {name: quarter, namespace: ml}
spec:
  containers:
  - {name: train, image: cuda, resources: {limits: {nvidia.com/gpu: "0.25"}}}
"""


def test_review_follows_the_namespace_mode(tmp_path):
    manifest = tmp_path / "ns.yaml"
    manifest.write_text(NAMESPACES)
    code, text = review(manifest)
    assert code == 1
    headers = [line for line in text.splitlines() if line.startswith("# gpushard: Pod")]
    assert headers[0].endswith(': not rewritten: namespace "web" has no gpushard.io/mode label, so the webhook '
                               "never sees it")
    assert 'Pod web/grab' in headers[1] and 'denied (403): gpushard: container "train" asks gpushard.io/*' in headers[1]
    assert "label the namespace gpushard.io/mode=enforce" in headers[1]
    assert headers[2].endswith("allowed unchanged, 1 finding(s)")
    assert "admitted: 25 shares of card" in headers[3], "a namespace not among the files takes --mode"
    docs = [d for d in yaml.safe_load_all(text) if d and d.get("kind") == "Pod"]
    assert [d["metadata"]["name"] for d in docs] == ["site", "quarter"]
    assert docs[0] == yaml.safe_load(NAMESPACES.split("---")[2]), "an object outside enforce is printed unchanged"
    # --mode none: the same for objects whose namespace is not among the files.
    code, text = review(manifest, mode="none")
    assert "Pod ml/quarter" in text and "not rewritten: review ran with --mode none" in text


def test_review_packs_pods_of_one_run(tmp_path):
    manifest = tmp_path / "pods.yaml"
    manifest.write_text("\n---\n".join(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{i}", "namespace": "t"},
        "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "0.5"}}}]}})
        for i in range(3)))
    code, text = review(manifest)
    assert code == 0
    # gpu-node-b's card 0 is empty and untainted: two halves fill it; then nothing the pod may
    # use has room (gpu-node-a is tainted), so the card with the most room is taken, with a warning.
    lines = [line for line in text.splitlines() if line.startswith("# gpushard:")]
    assert [line.rsplit(": ", 1)[1] for line in lines] == [
        "50 shares of card 0 on node gpu-node-b", "50 shares of card 0 on node gpu-node-b", "50 shares of card 1"]
    assert "no card has 50 free shares now" in text


def test_review_audit_mode_changes_nothing():
    code, text = review(EXAMPLES / "demo" / "02-inference-with-sidecar.yaml", mode="audit")
    assert code == 0 and "allowed unchanged, 3 finding(s)" in text
    assert "would replace" in text


def test_unreadable_files_exit_2(tmp_path, capsys):
    code, _ = review(tmp_path / "missing.yaml")
    assert code == 2 and "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: [Pod\n")
    code, _ = review(bad)
    assert code == 2 and "bad.yaml is not valid YAML" in capsys.readouterr().err


def test_bad_config_stops_the_command_with_exit_2(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("policy: {placement: everywhere}\n")
    code = cli.main(["review", str(EXAMPLES / "demo" / "01-notebook-quarter.yaml"), "--config", str(config)])
    captured = capsys.readouterr()
    # 2 is bad input; 1 would read as "denied".
    assert code == 2 and captured.out == ""
    assert captured.err.startswith("gpushard: bad config: ") and "policy.placement" in captured.err


def test_demo_runs_end_to_end():
    done = subprocess.run([sys.executable, str(EXAMPLES / "demo.py")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "admitted: 25 shares, pinned to card 0 (node gpu-node-a preferred" in out
    assert "denied (403): gpushard: container \"train\" asks nvidia.com/gpu 1.5" in out
    assert "'NVIDIA_VISIBLE_DEVICES': 'void'" in out
    # Host access around the device plugin: every offending field named.
    assert 'denied (403): gpushard: volume "dev" is hostPath /dev (spec.volumes[0].hostPath.path)' in out
    assert 'container "shell" is privileged (spec.containers[0].securityContext.privileged)' in out
    # Limits the author wrote for itself are removed from the admitted pod.
    greedy = out[out.index("Pod research/greedy"):]
    greedy = greedy[:greedy.index("\n\n")]
    assert "admitted: 25 shares" in greedy and "NVIDIA_GPU_MEMORY_LIMIT'" not in greedy.split("warning:")[0]
    assert "audit annotation limit-env-set:" in greedy
    assert 'outcome="denied"} 4.0' in out
