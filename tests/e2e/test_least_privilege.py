"""We test, on the real kube-apiserver with deploy/base, what each of gpushard's accounts may do beyond what RBAC
says, as the API server itself judges it (server-side dry runs, with the account impersonated):
- the certificates' ServiceAccount may change each webhook's caBundle in the MutatingWebhookConfiguration gpushard,
  and nothing else there: a changed service or URL, failurePolicy, or match condition is refused with gpushard's
  message naming the webhook; an admin's change is not judged;
- someone bound to gpushard-cordoner may write the cordon annotations of a Node (`gpushard cordon`'s own patch),
  and nothing else there: another annotation, a label or unschedulable is refused, naming it; a cluster admin
  is not judged;
- a list of the device policies written so that it breaks out of its CEL string (as kustomize writes a
  device-policy.yaml value holding three quotes) is taken by the API server, which judges no policy object, and
  `gpushard audit` reports it, naming the policy and the variable.
"""

from __future__ import annotations

import base64
import json
import subprocess

from tests.e2e import components, gpushard

CERTS = "--as=system:serviceaccount:gpushard-system:gpushard-certs"


def patch(kubectl, ops: list[dict], *who: str):
    return kubectl.run("patch", "mutatingwebhookconfiguration", "gpushard", "--type=json", "--dry-run=server",
                       "-p", json.dumps(ops), *who, check=False)


def test_the_certificates_account_may_change_only_the_ca_bundles(installed, kubectl):
    config = kubectl.json("get", "mutatingwebhookconfiguration", "gpushard")
    hooks = config["webhooks"]
    bundle = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nnew\n-----END CERTIFICATE-----\n").decode()
    every = [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle} for i in range(len(hooks))]
    done = patch(kubectl, every, CERTS)
    assert done.returncode == 0, done.stderr
    where = "url" if "url" in hooks[0]["clientConfig"] else "service"
    other = "https://127.0.0.1:1/mutate" if where == "url" else {**hooks[0]["clientConfig"]["service"], "name": "x"}
    for ops, hook in (
            ([{"op": "replace", "path": f"/webhooks/0/clientConfig/{where}", "value": other}], hooks[0]["name"]),
            ([{"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Ignore"}], hooks[0]["name"]),
            ([{"op": "replace", "path": "/webhooks/1/matchConditions/0/expression", "value": "false"}],
             hooks[1]["name"])):
        done = patch(kubectl, ops, CERTS)
        assert done.returncode != 0, ops
        assert ('gpushard: the certificates\' ServiceAccount may change only clientConfig.caBundle, not webhook '
                f'"{hook}"') in done.stderr, done.stderr
        assert patch(kubectl, ops).returncode == 0, "an admin's change is not judged"


def test_a_device_policy_list_that_breaks_out_of_its_string_is_reported_by_the_audit(installed, kubectl):
    # As kustomize writes a device-policy.yaml value that holds three quotes: what follows is read as CEL. The
    # API server takes it (policies are exempt from policies and webhooks), so `gpushard audit` must say it.
    policy = kubectl.json("get", "validatingadmissionpolicy", "gpushard-device-channels")
    index = [v["name"] for v in policy["spec"]["variables"]].index("trustedNamespaces")
    shipped = policy["spec"]["variables"][index]["expression"]
    quotes = "'" * 3
    broken = f"r{quotes}{quotes} + request.namespace + r{quotes}{quotes}"
    path = f"/spec/variables/{index}/expression"
    kubectl.run("patch", "validatingadmissionpolicy", "gpushard-device-channels", "--type=json", "-p",
                json.dumps([{"op": "replace", "path": path, "value": broken}]))
    try:
        done = subprocess.run([gpushard.GPUSHARD, "audit", "-o", "json", f"--kubeconfig={kubectl.config}",
                               "--request-timeout=20s"], capture_output=True, text=True, timeout=90,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 1, done.stderr
        found = [x for x in json.loads(done.stdout)["findings"] if x["rule"] == "policy-list-not-names"]
        assert [x["name"] for x in found] == ["gpushard-device-channels"], found
        assert "variable trustedNamespaces is not one list of names" in found[0]["message"]
    finally:
        kubectl.run("patch", "validatingadmissionpolicy", "gpushard-device-channels", "--type=json", "-p",
                    json.dumps([{"op": "replace", "path": path, "value": shipped}]))


def test_a_card_cordoner_may_change_only_the_cordon_annotations(installed, kubectl, agent):
    # kubectl patch gets the Node first (gpushard cordon lists it): the test's user may get Nodes too.
    kubectl.apply(json.dumps({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                              "metadata": {"name": "e2e-node-reader"},
                              "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]}))
    for role in ("gpushard-cordoner", "e2e-node-reader"):
        kubectl.apply(json.dumps({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": f"e2e-cordoner-{role}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "e2e-cordoner"}]}))
    node = kubectl.json("get", "nodes")["items"][0]["metadata"]["name"]
    as_cordoner = "--as=e2e-cordoner"

    def merge(patch: dict, *who: str):
        return kubectl.run("patch", "node", node, "--type=merge", "--dry-run=server", "-p", json.dumps(patch), *who,
                           check=False)

    try:
        cordon = {"metadata": {"annotations": {"gpushard.io/card-1.cordoned": '{"reason": "e2e"}'}}}
        result = {}

        def cordoned() -> bool:
            result["done"] = merge(cordon, as_cordoner)
            return result["done"].returncode == 0
        # The binding reaches the API server's authorizer through its informer.
        components.wait_for("the cordoner's patch allowed", cordoned, timeout=30,
                            explain=lambda: result["done"].stderr)
        prefix = "gpushard: a card cordoner may change only the annotations gpushard.io/card-<k>.cordoned of a Node"
        for patch, said in (({"metadata": {"annotations": {"evil": "x"}}}, 'not "evil"'),
                            ({"metadata": {"labels": {"gpushard.io/x": "y"}}}, "not metadata.labels"),
                            ({"spec": {"unschedulable": True}}, "not spec")):
            done = merge(patch, as_cordoner)
            assert done.returncode != 0 and prefix in done.stderr and said in done.stderr, done.stderr
            assert merge(patch).returncode == 0, "an admin is not judged"
    finally:
        kubectl.run("delete", "clusterrolebinding", "e2e-cordoner-gpushard-cordoner", "e2e-cordoner-e2e-node-reader",
                    check=False)
        kubectl.run("delete", "clusterrole", "e2e-node-reader", check=False)
