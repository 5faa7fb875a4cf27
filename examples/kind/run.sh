#!/usr/bin/env bash
# gpushard end to end on a local kind cluster with fake cards: build the image, load it,
# install, opt a namespace in, run pods of 0.25 and 0.5 of a card, show where they landed.
# Needs docker (or podman with KIND_EXPERIMENTAL_PROVIDER=podman), kind >= 0.24, kubectl.
# Remove everything afterwards with: kind delete cluster --name gpushard
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER="${CLUSTER:-gpushard}"
IMAGE="gpushard:dev"
for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { echo "gpushard: $tool is needed for this example" >&2; exit 1; }
done
k() { kubectl --context "kind-$CLUSTER" "$@"; }

docker build -t "$IMAGE" .
if ! kind get clusters | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --config examples/kind/kind-cluster.yaml
fi
kind load docker-image "$IMAGE" --name "$CLUSTER"

k apply -k examples/kind
k -n gpushard-system wait --for=condition=complete job/gpushard-certs --timeout=180s
k -n gpushard-system rollout status deployment/gpushard-webhook --timeout=180s
k -n gpushard-system rollout status daemonset/gpushard-agent --timeout=180s
echo "gpushard: waiting for the shared nodes to advertise shares"
until k get nodes -l gpushard.io/shared-node=true \
    -o jsonpath='{.items[*].status.allocatable.gpushard\.io/gpu}' | grep -q '[0-9]'; do
  sleep 2
done

k create namespace demo --dry-run=client -o yaml | k apply -f -
k label namespace demo gpushard.io/mode=enforce --overwrite
for spec in quarter-a:0.25 quarter-b:0.25 half-a:0.5 half-b:0.5; do
  name="${spec%%:*}" fraction="${spec##*:}"
  k -n demo apply -f - <<POD
apiVersion: v1
kind: Pod
metadata: {name: $name}
spec:
  containers:
  - name: main
    image: busybox:1.36
    command: [sh, -c, 'echo "card \$NVIDIA_VISIBLE_DEVICES fraction \$GPUSHARD_FRACTION"; sleep 3600']
    resources: {limits: {nvidia.com/gpu: "$fraction"}}
POD
done
k -n demo wait --for=condition=Ready pod --all --timeout=180s
k -n demo get pods -o custom-columns='POD:.metadata.name,NODE:.spec.nodeName,CARD:.metadata.annotations.gpushard\.io/card,SHARES:.metadata.annotations.gpushard\.io/shares'
k get nodes -l gpushard.io/shared-node=true \
  -o custom-columns='NODE:.metadata.name,CARDS:.metadata.labels.gpushard\.io/cards,SHARES:.status.allocatable.gpushard\.io/gpu'
