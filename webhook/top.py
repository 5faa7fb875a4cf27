"""`gpushard top`: shares held against memory and utilization used, per node, card and pod.

Read from every agent's metrics through a port-forward by the API server
(``/api/v1/namespaces/<ns>/pods/<agent>/portforward``), so it needs no route to the nodes, only
the right to list the agents' pods and to port-forward to them, in their namespace. The agents
serve per-container data only to a token the API server authorizes, or to their own loopback,
which is where a port-forward arrives: the API server already checked the caller's right to it,
whatever credentials the caller holds (client certificates too). The pod proxy would not do: it
drops the caller's Authorization header after authenticating it and reaches the pod from the
API server's own address, so the agent could not tell its caller from any pod on the network.
"""

from __future__ import annotations

import http.client
import json
import re
import ssl
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import IO

from prometheus_client.parser import text_string_to_metric_families

from webhook import kubectlflags, tables
from webhook.kubeapi import connecting

AGENT_NAMESPACE = "gpushard-system"
AGENT_SELECTOR = "app.kubernetes.io/name=gpushard,app.kubernetes.io/component=agent"
METRICS_PORT_NAME = "metrics"
DEFAULT_PORT = 9401
TIMEOUT_S = 10.0
MIB = 1024 * 1024
API_VERSION = "gpushard.io/v1"  # as `status -o json` and `audit -o json`


class TopError(Exception):
    """Nothing to show; the message says why."""


def rights(namespace: str) -> str:
    """What grants top's calls in the agents' namespace, told with a 403."""
    return (f'the Role gpushard-top in namespace "{namespace}" grants it (deploy/base/rbac-top.yaml): bind it to '
            "this account with a RoleBinding there")


@dataclass
class CardTop:
    node: str
    gpu: int
    uuid: str
    model: str
    shares: int | None = None  # None: unknown (the agent cannot reach the kubelet's PodResources)
    capacity: int = 0
    memory_used: int | None = None
    memory_total: int | None = None
    utilization: float | None = None  # 0..1
    healthy: bool = True
    unattributed_memory: int | None = None  # None: unknown, as the shares
    kubelet_reachable: bool = True  # the agent's PodResources answered its last scrape
    cordoned: bool = False  # an operator cordoned it: its shares are not offered to new pods


@dataclass
class PodTop:
    node: str
    namespace: str
    pod: str
    container: str
    gpu: int
    shares: int = 0
    memory_used: int | None = None
    memory_share: int = 0
    memory_cap: int | None = None
    memory_asked: int | None = None  # its pod's memory ask, where the pod was placed by one
    utilization: float | None = None  # 0..1, its processes' share of the card's SM time
    over_share: bool = False


@dataclass
class Agent:
    pod: str
    node: str
    port: int


def parse(text: str) -> tuple[list[CardTop], list[PodTop]]:
    """Cards and containers from one agent's metrics text."""
    cards: dict[tuple[str, int], CardTop] = {}
    pods: dict[tuple, PodTop] = {}
    card_fields = {"gpushard_card_shares_allocated": "shares", "gpushard_card_shares_capacity": "capacity",
                   "gpushard_card_memory_used_bytes": "memory_used", "gpushard_card_memory_total_bytes": "memory_total",
                   "gpushard_card_utilization_ratio": "utilization", "gpushard_card_healthy": "healthy",
                   "gpushard_card_unattributed_memory_bytes": "unattributed_memory",
                   "gpushard_card_cordoned": "cordoned"}
    pod_fields = {"gpushard_container_shares": "shares", "gpushard_container_memory_used_bytes": "memory_used",
                  "gpushard_container_memory_share_bytes": "memory_share",
                  "gpushard_container_memory_cap_bytes": "memory_cap", "gpushard_container_over_share": "over_share",
                  "gpushard_container_utilization_ratio": "utilization"}
    asked: dict[tuple[str, str, str, int], int] = {}  # (node, namespace, pod, gpu) -> bytes
    unreachable: set[str] = set()  # nodes whose agent cannot reach the kubelet's PodResources
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gpushard_agent_podresources_up":
                if sample.value < 1:
                    unreachable.add(labels.get("node", ""))
                continue
            try:
                gpu = int(labels.get("gpu", ""))
            except ValueError:
                continue
            if sample.name in card_fields:
                key = (labels.get("node", ""), gpu)
                card = cards.setdefault(key, CardTop(key[0], gpu, labels.get("UUID", ""), labels.get("modelName", "")))
                field = card_fields[sample.name]
                setattr(card, field, _typed(field, sample.value))
            elif sample.name in pod_fields:
                pod_key = (labels.get("node", ""), labels.get("namespace", ""), labels.get("pod", ""),
                           labels.get("container", ""), gpu)
                pod = pods.setdefault(pod_key, PodTop(*pod_key))
                field = pod_fields[sample.name]
                setattr(pod, field, _typed(field, sample.value))
            elif sample.name == "gpushard_pod_memory_asked_bytes":
                asked[(labels.get("node", ""), labels.get("namespace", ""), labels.get("pod", ""), gpu)] = \
                    int(sample.value)
    for pod_key, pod in pods.items():
        pod.memory_asked = asked.get((*pod_key[:3], pod_key[4]))
    for card in cards.values():
        if card.node in unreachable:
            # An older agent exported 0 for what it did not know: unknown all the same.
            card.kubelet_reachable, card.shares, card.unattributed_memory = False, None, None
    return list(cards.values()), list(pods.values())


def _typed(field: str, value: float):
    if field in ("healthy", "over_share", "cordoned"):
        return value >= 1
    if field == "utilization":
        return value
    return int(value)


def find_agents(core, namespace: str, timeout: float | None = TIMEOUT_S) -> list[Agent]:
    """The running agent pods and the port each serves its metrics on."""
    response = core.list_namespaced_pod(namespace, label_selector=AGENT_SELECTOR, _preload_content=False,
                                        _request_timeout=timeout)
    body = json.loads(response.data)
    agents = []
    for pod in body.get("items") or []:
        if (pod.get("status") or {}).get("phase") != "Running":
            continue
        port = None
        for container in (pod.get("spec") or {}).get("containers") or []:
            for p in container.get("ports") or []:
                if p.get("name") == METRICS_PORT_NAME:
                    port = p.get("containerPort")
        agents.append(Agent(pod["metadata"]["name"], (pod.get("spec") or {}).get("nodeName") or "",
                            int(port or DEFAULT_PORT)))
    return sorted(agents, key=lambda a: a.node)


class ScrapeError(Exception):
    """The agent, or the port-forward to it, refused or failed; ``status`` is the HTTP status when there is one."""

    def __init__(self, message: str, status: int | None = None, reason: str = "", detail: str = ""):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.detail = detail  # the API server's own message, where it sent one


def _forward(core, namespace: str, agent: Agent, timeout: float | None):
    import kubernetes
    import websocket
    from kubernetes import stream

    previous = websocket.getdefaulttimeout()
    websocket.setdefaulttimeout(timeout)  # the client's port-forward has no timeout of its own
    try:
        return stream.portforward(core.connect_get_namespaced_pod_portforward, agent.pod, namespace,
                                  ports=str(agent.port))
    except kubernetes.client.ApiException as exc:
        if isinstance(exc.__context__, (KeyboardInterrupt, SystemExit)):
            # The client's port-forward turns even Ctrl-C into an ApiException (status 0): give it back.
            raise exc.__context__ from None
        found = re.search(r"Handshake status (\d+) ?([A-Za-z ]*)", str(exc.reason))
        if found:
            # The API server's refusal: its Status message follows the headers.
            detail = re.search(r'"message": ?"((?:[^"\\]|\\.)*)"', str(exc.reason))
            status, reason = int(found[1]), found[2].strip()
            said = json.loads(chr(34) + detail[1] + chr(34)) if detail else ""
            raise ScrapeError(f"HTTP {status} {reason}" + (f": {said}" if said else ""), status, reason, said) from None
        raise ScrapeError(f"port-forward failed: {exc.reason}") from None
    finally:
        websocket.setdefaulttimeout(previous)


def scrape(core, namespace: str, agent: Agent, timeout: float | None = TIMEOUT_S) -> str:
    """One agent's metrics text, over TLS through a port-forward by the API server.

    The agent's certificate is made at its start and verified by nobody: the tunnel's ends are the
    API server (whose certificate the kubeconfig verifies) and the agent pod the kubelet opens it
    into, so no one else is on the way.
    """
    forward = _forward(core, namespace, agent, timeout)
    try:
        plain = forward.socket(agent.port)
        plain.settimeout(timeout)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        try:
            with context.wrap_socket(plain, server_hostname="localhost") as tls:
                tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                response = http.client.HTTPResponse(tls)
                response.begin()
                body = response.read()
        except TimeoutError:  # socket.timeout, the TLS handshake's too: an agent that accepts and never answers
            raise ScrapeError(f"no answer within {timeout:g}s through the port-forward" if timeout
                              else "no answer through the port-forward") from None
        except (OSError, http.client.HTTPException) as exc:
            error = forward.error(agent.port)
            raise ScrapeError(f"port-forward failed: {(error or str(exc) or type(exc).__name__).strip()}") from None
        if response.status != 200:
            detail = body.decode("utf-8", errors="replace").strip()
            raise ScrapeError(f"HTTP {response.status} {response.reason}" + (f": {detail}" if detail else ""),
                              response.status, response.reason)
        return body.decode("utf-8", errors="replace")
    finally:
        forward.close()


AGENT_PODS = "kubectl -n {namespace} get pods -l app.kubernetes.io/component=agent -o wide"


def gather(core, namespace: str, node: str | None = None, err: IO[str] | None = None,
           timeout: float | None = TIMEOUT_S, where: str = "the cluster"
           ) -> tuple[list[CardTop], list[PodTop]]:
    """Cards and containers of every agent (or of ``node``'s); an agent that does not answer is named on ``err``.

    A port-forward refused for the credentials (401, 403) is a ScrapeError: every agent would get the same.
    ``where`` names the API server and context in the messages.
    """
    err = err or sys.stderr
    agents = [a for a in find_agents(core, namespace, timeout) if node is None or a.node == node]
    if not agents and node:
        raise TopError(f"gpushard: no running agent on node {node!r} in namespace {namespace!r} at {where}; check "
                       f"the node's name (kubectl get nodes) and that an agent runs there "
                       f"({AGENT_PODS.format(namespace=namespace)})")
    if not agents:
        raise TopError(f"gpushard: no running agent in namespace {namespace!r} (pods labelled {AGENT_SELECTOR}) "
                       f"at {where}; if gpushard runs in another namespace pass --agent-namespace, else check its "
                       f"agent DaemonSet (kubectl -n {namespace} get daemonset gpushard-agent)")
    cards: list[CardTop] = []
    pods: list[PodTop] = []
    answered = 0
    for agent in agents:
        try:
            text = scrape(core, namespace, agent, timeout)
        except Exception as exc:  # one node away must not hide the others
            status = getattr(exc, "status", None)
            if isinstance(exc, ScrapeError) and status in (401, 403):
                raise
            if isinstance(exc, ScrapeError) or not status:
                why = str(exc) if isinstance(exc, ScrapeError) else connecting.failure_text(exc)
            else:
                why = f"HTTP {status} {getattr(exc, 'reason', '')}".strip()
            if why == "timed out" and timeout:
                why = f"no answer within {timeout:g}s through the port-forward"
            print(f"gpushard: cannot read the metrics of agent {agent.pod} on node {agent.node!r}: {why}; read its "
                  f"log (kubectl -n {namespace} logs {agent.pod})", file=err)
            continue
        answered += 1
        c, p = parse(text)
        cards += c
        pods += p
    if not answered:
        raise TopError(f"gpushard: no agent answered at {where} (each is named above with why); check that the "
                       "agents serve metrics (--metrics-port, 9401 in deploy/base/agent.yaml) and read their log "
                       f"(kubectl -n {namespace} logs daemonset/gpushard-agent)")
    return (sorted(cards, key=lambda c: (c.node, c.gpu)),
            sorted(pods, key=lambda p: (p.node, p.gpu, p.namespace, p.pod, p.container)))


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{round(value / MIB)}Mi"


def _table(header: list[str], rows: Iterable[list[str]], no_headers: bool = False) -> str:
    return tables.aligned(list(rows), None if no_headers else header)


def cards_table(cards: list[CardTop], no_headers: bool = False) -> str:
    return _table(["NODE", "GPU", "MODEL", "SHARES", "MEMORY", "UTIL", "UNATTRIBUTED", "HEALTH"], [
        [c.node, str(c.gpu), c.model, f"{'?' if c.shares is None else c.shares}/{c.capacity}",
         f"{_mib(c.memory_used)}/{_mib(c.memory_total)}",
         _percent(c.utilization),
         _mib(c.unattributed_memory),
         ("Healthy" if c.healthy else "Unhealthy") + (", cordoned" if c.cordoned else "")
         + ("" if c.kubelet_reachable else ", kubelet unreachable")]
        for c in cards], no_headers)


def unreachable_nodes(cards: list[CardTop]) -> list[str]:
    """Nodes whose agent cannot reach the kubelet's PodResources: there, who holds shares is unknown."""
    return sorted({c.node for c in cards if not c.kubelet_reachable})


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


# Byte counts say so in their JSON names, as the metrics do.
_JSON_NAMES = {"memory_used": "memoryUsedBytes", "memory_total": "memoryTotalBytes",
               "memory_share": "memoryShareBytes", "memory_cap": "memoryCapBytes",
               "memory_asked": "memoryAskedBytes",
               "unattributed_memory": "unattributedMemoryBytes", "uuid": "UUID"}


def _document(row) -> dict:
    return {_JSON_NAMES.get(k, _camel(k)): v for k, v in asdict(row).items()}


def top_json(cards: list[CardTop], pods: list[PodTop], what: str = "all") -> dict:
    """The `-o json|yaml` document: a versioned kind, camelCase keys, as `status` and `audit` write."""
    body: dict = {"apiVersion": API_VERSION, "kind": "TopReport"}
    if what in ("all", "cards"):
        body["cards"] = [_document(c) for c in cards]
    if what in ("all", "pods"):
        body["pods"] = [_document(p) for p in pods]
    body["kubeletUnreachable"] = unreachable_nodes(cards)
    return body


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{round(value * 100)}%"


def pods_table(pods: list[PodTop], no_headers: bool = False) -> str:
    return _table(["NAMESPACE", "POD", "CONTAINER", "NODE", "GPU", "SHARES", "MEMORY", "MEMORY-SHARE", "ASKED", "CAP",
                   "UTIL", ""], [
        [p.namespace, p.pod, p.container, p.node, str(p.gpu), str(p.shares), _mib(p.memory_used),
         _mib(p.memory_share), _mib(p.memory_asked), _mib(p.memory_cap), _percent(p.utilization),
         "OVER" if p.over_share else ""]
        for p in pods], no_headers)


def run_top(args, conn: connecting.Client, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """`gpushard top [cards|pods]`: the exit status (webhook.kubectlflags.EXIT_CODES).

    No agent to read, or none answering, is exit 3, as for a cluster that lacks what a command needs.
    """
    import kubernetes

    out, err = out or sys.stdout, err or sys.stderr
    core = kubernetes.client.CoreV1Api(conn.api)
    timeout = conn.timeout if conn.timeout is not None else TIMEOUT_S
    conn.target.rights = rights(args.agent_namespace)
    listing = f'list pods in namespace "{args.agent_namespace}"'
    try:
        try:
            with connecting.reaching(conn.target, listing):
                cards, pods = gather(core, args.agent_namespace, args.node, err, timeout, conn.target.where)
        except ScrapeError as exc:  # a port-forward refused for the credentials
            forward = f'port-forward to the agent pods in namespace "{args.agent_namespace}" (pods/portforward)'
            if exc.status == 401:
                raise connecting.unauthorized(conn.target.where, forward) from None
            raise connecting.forbidden(conn.target.where, forward, exc.detail or exc.reason,
                                       conn.target.rights) from None
        except kubernetes.client.ApiException as exc:  # any other refusal of the list
            raise connecting.answered(conn.target.where, listing, exc) from None
    except (TopError, connecting.ApiError) as exc:
        print(exc, file=err)
        return kubectlflags.UNREACHABLE
    namespace = kubectlflags.namespace_of(args, conn.target)
    if namespace:
        pods = [p for p in pods if p.namespace == namespace]
    if args.sort_by == "memory":
        pods.sort(key=lambda p: -(p.memory_used or 0))
    elif args.sort_by == "shares":
        pods.sort(key=lambda p: -p.shares)
    if args.output in (kubectlflags.JSON, kubectlflags.YAML):
        body = top_json(cards, pods, args.what)
        if args.output == kubectlflags.JSON:
            out.write(json.dumps(body, indent=2) + "\n")
        else:
            import yaml

            out.write(yaml.safe_dump(body, sort_keys=False))
        return kubectlflags.OK
    parts = []
    away = unreachable_nodes(cards)
    if args.what in ("all", "cards"):
        parts.append(cards_table(cards, args.no_headers))
    if args.what in ("all", "pods"):
        if pods:
            parts.append(pods_table(pods, args.no_headers))
        elif not away:
            parts.append("No containers hold shares.\n")
    out.write("\n".join(parts))
    for node in away:
        print(f"gpushard: the agent on node {node!r} cannot reach the kubelet's PodResources API: who holds "
              "shares there is unknown (not 0); see its log, and the kubelet's pod-resources socket", file=err)
    return kubectlflags.OK
