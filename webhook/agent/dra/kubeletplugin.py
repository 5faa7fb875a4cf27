"""The kubelet's DRA plugin for gpushard's driver: registration, NodePrepareResources, NodeUnprepareResources.

The kubelet's plugin watcher finds our registration socket in its plugins_registry folder, asks
GetInfo, and then calls the DRAPlugin service at the endpoint we gave. It names each claim only
by namespace, name and UID, so the plugin reads the claim from the API server to learn what the
scheduler allocated (the card, the shares it consumed) and answers with CDI device IDs: the card
as the node's NVIDIA CDI spec names it, and gpushard's per-claim device with the claim's limits.
What was prepared is kept in a checkpoint file, so preparing again (a restarted kubelet does)
answers the same without the API server, and unprepare knows what to remove after our restart.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, cast

import grpc
import kubernetes

from webhook.agent.dra import cdi, resourcehealth
from webhook.agent.node import allocation, containerlimits, nvml, sockets
from webhook.agent.proto import dra_health_pb2 as hpb
from webhook.agent.proto import dra_pb2 as dpb
from webhook.agent.proto import dra_pb2_grpc as dpb_grpc
from webhook.agent.proto import pluginregistration_pb2 as rpb
from webhook.agent.proto import pluginregistration_pb2_grpc as rpb_grpc
from webhook.core import draobjects, names, quantities

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1 constants.go
SUPPORTED_VERSIONS = ("v1.DRAPlugin",)  # dra/v1 types.go: DRAPluginService
# The health services the plugin serves, newest first (dra-health/v1 and v1alpha1 types.go). kubelet 1.37 opens
# the first one a plugin advertises among its supported versions, and none when it advertises none
# (cm/dra/plugin/dra_plugin_manager.go, pickHealthService); 1.36 calls v1alpha1 unasked. v1's messages are
# v1alpha1's field for field, so one servicer answers under both names.
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIR = "/var/lib/kubelet/plugins"
CHECKPOINT_VERSION = 1
# Claims prepared at once: calls for claims under different locks never wait on each other.
CLAIM_LOCKS = 64


def registration_socket(registry_dir: str, driver: str) -> str:
    return os.path.join(registry_dir, f"{driver}-reg.sock")


def plugin_socket(plugins_dir: str, driver: str) -> str:
    return os.path.join(plugins_dir, driver, "dra.sock")


@dataclass(frozen=True)
class Prepared:
    """One device the kubelet gets for a claim: where it came from and its CDI device IDs."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]


class Checkpoint:
    """What is prepared, by claim UID, in one JSON file written atomically."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.claims: dict[str, dict] = {}
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path) as source:
                data = json.load(source)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            # A checkpoint we cannot read would leave claims prepared for good; start over loudly and let
            # the kubelet prepare again (it does for every running pod after our restart).
            log.error("gpushard: cannot read the DRA checkpoint %s (%s); starting with none", self.path, exc)
            return
        if isinstance(data, dict) and data.get("version") == CHECKPOINT_VERSION and isinstance(
                data.get("claims"), dict):
            self.claims = data["claims"]
        else:
            log.error("gpushard: the DRA checkpoint %s is of an unknown version; starting with none", self.path)

    def save(self) -> None:
        cdi.write_json(self.path, {"version": CHECKPOINT_VERSION, "claims": self.claims})

    def devices(self, uid: str) -> list[Prepared] | None:
        entry = self.claims.get(uid)
        if entry is None:
            return None
        return [Prepared(tuple(d["request_names"]), d["pool_name"], d["device_name"], tuple(d["cdi_device_ids"]))
                for d in entry["devices"]]


class PrepareError(RuntimeError):
    """A claim that could not be prepared; the message (starting gpushard:) goes back to the kubelet."""


def api_claim_reader(api: kubernetes.client.ApiClient, timeout: float = 10.0) -> Callable[[str, str], dict]:
    """Reads a ResourceClaim from the API server (the kubelet names claims, it does not send them)."""
    custom = kubernetes.client.CustomObjectsApi(api)
    group, version = names.DRA_API_VERSION.split("/")

    def read(namespace: str, name: str) -> dict:
        return cast(dict, custom.get_namespaced_custom_object(group, version, namespace, "resourceclaims", name,
                                                              _request_timeout=timeout))
    return read


def api_pod_reader(api: kubernetes.client.ApiClient, timeout: float = 10.0) -> Callable[[str, str], dict]:
    """Reads a Pod from the API server, as the API serves it (the pod a claim is reserved for)."""
    core = kubernetes.client.CoreV1Api(api)

    def read(namespace: str, name: str) -> dict:
        # The HTTP response (read raw), not the V1Pod the client's annotation names.
        answer: Any = core.read_namespaced_pod(name, namespace, _preload_content=False, _request_timeout=timeout)
        return json.loads(answer.data)
    return read


def _read_failed(what: str, exc: Exception) -> PrepareError:
    if isinstance(exc, kubernetes.client.exceptions.ApiException):
        return PrepareError(f"gpushard: cannot read {what} from the API server: HTTP {exc.status} {exc.reason}")
    return PrepareError(f"gpushard: cannot read {what} from the API server: {exc}")


class Preparer:
    """Prepares and unprepares claims: the allocation read, the CDI spec written, the checkpoint kept.

    Knows nothing of gRPC; the servicer translates. The kubelet may call concurrently: one claim's calls take
    turns (a lock of its own among ``CLAIM_LOCKS``), and the checkpoint and the CDI folder are changed under one
    short lock that is never held across an API call, so that a slow API server delays only the claims waiting
    on it, never another claim's preparation or a metrics scrape.
    """

    def __init__(self, node: str, cards: Callable[[], Mapping[int, nvml.Card]], shares_per_card: int,
                 read_claim: Callable[[str, str], dict], checkpoint: Checkpoint, cdi_dir: str = cdi.DEFAULT_DIR,
                 mode: str = "none", mps_root: containerlimits.MpsRoot | None = None,
                 driver: str = names.DRA_DRIVER, read_pod: Callable[[str, str], dict] | None = None,
                 pod_shares: Callable[[dict], int] | None = None,
                 refusal: Callable[[], str | None] | None = None) -> None:
        self.node = node
        self.cards = cards
        # Why no new claim may be prepared on this node now (its runtime applies no CDI device), or None.
        self.refusal = refusal
        self.shares_per_card = shares_per_card
        self.read_claim = read_claim
        self.checkpoint = checkpoint
        self.cdi_dir = cdi_dir
        self.mode = mode
        self.mps_root = mps_root
        self.driver = driver
        # With both, a claim is prepared only for the one pod it is reserved for, and only when it consumes
        # the shares that pod counts (its gpushard.io/gpu, what quota saw): a claim made any other way than
        # from gpushard's template for that pod is refused here, whatever the admission policies let through.
        self.read_pod = read_pod
        self.pod_shares = pod_shares
        self._lock = threading.Lock()  # the checkpoint and the CDI folder
        self._claim_locks = [threading.Lock() for _ in range(CLAIM_LOCKS)]

    def _claim_lock(self, uid: str) -> threading.Lock:
        """The lock one claim's prepare and unprepare take turns under (shared with a few other claims)."""
        return self._claim_locks[zlib.crc32(uid.encode()) % len(self._claim_locks)]

    def _prepared(self, uid: str) -> list[Prepared] | None:
        with self._lock:
            done = self.checkpoint.devices(uid)
            if done is not None:
                # Prepared before (a restarted kubelet asks again): the same answer, from the checkpoint, with
                # its CDI spec there for the runtime.
                self._restore(uid, self.checkpoint.claims[uid])
            return done

    def prepare(self, namespace: str, uid: str, name: str) -> list[Prepared]:
        with self._claim_lock(uid):
            done = self._prepared(uid)
            if done is not None:
                return done
            named = f"{namespace}/{name}"
            refused = self.refusal() if self.refusal is not None else None
            if refused:
                # The container would start without its card: the kubelet puts this in the pod's events instead.
                raise PrepareError(f"gpushard: claim {named} cannot be prepared on node {self.node!r}: {refused}")
            try:
                claim = self.read_claim(namespace, name)
            except kubernetes.client.exceptions.ApiException as exc:
                raise PrepareError(f"gpushard: cannot read claim {named} from the API server: "
                                   f"HTTP {exc.status} {exc.reason}") from None
            except Exception as exc:  # unreachable, timed out: the kubelet retries the call
                raise PrepareError(f"gpushard: cannot read claim {named} from the API server: {exc}") from None
            if (claim.get("metadata") or {}).get("uid") != uid:
                raise PrepareError(f"gpushard: claim {named} has UID {(claim.get('metadata') or {}).get('uid')!r}, "
                                   f"not {uid!r}: it was deleted and made again")
            try:
                results = draobjects.our_results(claim, self.driver, self.shares_per_card)
            except draobjects.ClaimError as exc:
                raise PrepareError(str(exc)) from None
            if self.read_pod is not None and self.pod_shares is not None:
                self._check_holder(claim, named, sum(r.shares for r in results))
            cards = self.cards()
            devices, cdi_devices = [], []
            for result in results:
                card = cards.get(result.card)
                if result.pool != draobjects.pool_name(self.node) or card is None:
                    raise PrepareError(f"gpushard: claim {named} was given {result.pool}/{result.device}, which "
                                       f"is not a card of node {self.node!r}")
                own = f"{uid}-{result.device}"
                cdi_devices.append(cdi.Device(own, self._answer(card, result.shares)))
                devices.append(Prepared((result.request,) if result.request else (), result.pool, result.device,
                                        (f"{names.NVIDIA_CDI_KIND}={card.uuid}", cdi.qualified(own))))
            with self._lock:
                try:
                    written = cdi.spec(cdi_devices)
                    cdi.write(self.cdi_dir, uid, written)
                except (OSError, cdi.CdiError) as exc:
                    raise PrepareError(f"gpushard: cannot write the CDI spec for claim {named}: {exc}") from None
                # The spec is kept too: the CDI folder is often a tmpfs (/var/run/cdi), gone at a reboot, while
                # the kubelet, whose own checkpoint still holds the claim prepared, starts the pod's containers
                # again without asking (restore_specs).
                self.checkpoint.claims[uid] = {"namespace": namespace, "name": name,
                                               "devices": [_listed(d) for d in devices], "cdi": written,
                                               **_holder_of(claim)}
                self.checkpoint.save()
            log.info("gpushard: prepared claim %s (%s): %s", named, uid,
                     ", ".join(f"{r.device} x{r.shares}" for r in results))
            return devices

    def restore_specs(self) -> int:
        """Write again the CDI spec of every prepared claim whose spec is gone (a node reboot empties a tmpfs
        /var/run/cdi; the kubelet then starts the claim's containers again from its own checkpoint, naming
        the spec's devices without preparing again); the number written."""
        with self._lock:
            return sum(self._restore(uid, entry) for uid, entry in list(self.checkpoint.claims.items()))

    def _restore(self, uid: str, entry: dict) -> bool:
        if os.path.exists(cdi.spec_path(self.cdi_dir, uid)):
            return False
        named = f"{entry.get('namespace')}/{entry.get('name')} ({uid})"
        written = entry.get("cdi")
        if not isinstance(written, dict):
            log.error("gpushard: the CDI spec of claim %s is gone and the checkpoint, written by an older agent, "
                      "does not keep it: its containers cannot start until the pod is made again", named)
            return False
        try:
            cdi.write(self.cdi_dir, uid, written)
        except OSError as exc:
            log.error("gpushard: cannot write the CDI spec of claim %s again: %s", named, exc)
            return False
        log.info("gpushard: wrote the CDI spec of claim %s again (it was gone, as after a reboot)", named)
        return True

    def _check_holder(self, claim: dict, named: str, consumed: int) -> None:
        assert self.read_pod is not None and self.pod_shares is not None  # the caller checks both
        reserved = (claim.get("status") or {}).get("reservedFor")
        pods = [r for r in reserved if isinstance(r, dict) and r.get("resource") == "pods"] \
            if isinstance(reserved, list) else []
        if len(pods) != 1:
            raise PrepareError(f"gpushard: claim {named} is reserved for {len(pods)} pods; a claim of gpushard's "
                               "class serves exactly the one pod it was made for")
        namespace = named.split("/", 1)[0]
        holder = f"{namespace}/{pods[0].get('name')}"
        try:
            pod = self.read_pod(namespace, str(pods[0].get("name")))
        except Exception as exc:  # unreachable, timed out, gone: the kubelet retries the call
            raise _read_failed(f"pod {holder}", exc) from None
        if (pod.get("metadata") or {}).get("uid") != pods[0].get("uid"):
            raise PrepareError(f"gpushard: pod {holder} is not the one claim {named} is reserved for (UID "
                               f"{(pod.get('metadata') or {}).get('uid')!r}, not {pods[0].get('uid')!r})")
        try:
            counted = self.pod_shares(pod)
        except ValueError as exc:  # the core's ObjectError: a pod whose resources cannot be read
            raise PrepareError(f"gpushard: cannot count the shares of pod {holder}: {exc}") from None
        if counted != consumed:
            raise PrepareError(f"gpushard: claim {named} consumes {consumed} shares but pod {holder} counts "
                               f"{counted} ({names.SHARES_RESOURCE}, what quota saw); a claim of gpushard's class "
                               "comes only from gpushard's template for its pod's shares")

    def _answer(self, card: nvml.Card, shares: int) -> allocation.Allocation:
        fraction = quantities.fraction_text(shares, self.shares_per_card)
        limits = containerlimits.answer(card, shares, self.shares_per_card, self.mode, self.mps_root)
        # The fraction is always there: CDI refuses a device with no edits, and it tells the pod its part.
        return allocation.combined(allocation.Allocation({names.FRACTION_ENV: fraction}), limits)

    def cards_by_pod(self) -> dict[tuple[str, str], int]:
        """(namespace, pod) -> card index of each prepared claim reserved for one pod: which card a pod's
        containers use, for the metrics (PodResources names no card under backend dra). A claim prepared
        before the checkpoint recorded its pod is left out."""
        with self._lock:
            found = {}
            for entry in self.checkpoint.claims.values():
                pod = entry.get("pod")
                if not isinstance(pod, dict):
                    continue
                for device in entry.get("devices") or []:
                    card = draobjects.card_index(device.get("device_name"))
                    if card is not None:
                        found[(str(entry.get("namespace")), str(pod.get("name")))] = card
            return found

    def unprepare(self, namespace: str, uid: str, name: str) -> None:
        with self._claim_lock(uid), self._lock:
            removed = cdi.remove(self.cdi_dir, uid)
            if self.checkpoint.claims.pop(uid, None) is not None:
                self.checkpoint.save()
                log.info("gpushard: unprepared claim %s/%s (%s)", namespace, name, uid)
            elif removed:
                log.info("gpushard: removed a CDI spec for claim %s/%s (%s) the checkpoint did not list",
                         namespace, name, uid)


def _holder_of(claim: dict) -> dict:
    """The checkpoint's record of the one pod a claim is reserved for (none when it is not exactly one)."""
    reserved = (claim.get("status") or {}).get("reservedFor")
    pods = [r for r in reserved if isinstance(r, dict) and r.get("resource") == "pods"] \
        if isinstance(reserved, list) else []
    if len(pods) != 1:
        return {}
    return {"pod": {"name": str(pods[0].get("name")), "uid": str(pods[0].get("uid"))}}


def _listed(device: Prepared) -> dict:
    entry = asdict(device)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in entry.items()}


class DraServicer(dpb_grpc.DRAPluginServicer):
    """The DRAPlugin service: every claim of a call gets an entry, failed ones with their error."""

    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    def NodePrepareResources(self, request, context):
        response = dpb.NodePrepareResourcesResponse()
        for claim in request.claims:
            entry = response.claims[claim.uid]
            try:
                for device in self.preparer.prepare(claim.namespace, claim.uid, claim.name):
                    entry.devices.add(request_names=list(device.request_names), pool_name=device.pool_name,
                                      device_name=device.device_name, cdi_device_ids=list(device.cdi_device_ids))
            except PrepareError as exc:
                entry.error = str(exc)
                log.warning("%s", exc)
            except Exception as exc:  # one bad claim must not fail the others in the call
                log.exception("gpushard: preparing claim %s/%s failed", claim.namespace, claim.name)
                entry.error = f"gpushard: preparing claim {claim.namespace}/{claim.name} failed: {exc}"
        return response

    def NodeUnprepareResources(self, request, context):
        response = dpb.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            entry = response.claims[claim.uid]
            try:
                self.preparer.unprepare(claim.namespace, claim.uid, claim.name)
            except Exception as exc:
                log.exception("gpushard: unpreparing claim %s/%s failed", claim.namespace, claim.name)
                entry.error = f"gpushard: unpreparing claim {claim.namespace}/{claim.name} failed: {exc}"
        return response


class RegistrationServicer(rpb_grpc.RegistrationServicer):
    """Tells the kubelet's plugin watcher who we are and where the DRAPlugin service is."""

    def __init__(self, driver: str, endpoint: str, health: bool = False) -> None:
        versions = SUPPORTED_VERSIONS + (HEALTH_SERVICES if health else ())
        self.info = rpb.PluginInfo(type=PLUGIN_TYPE, name=driver, endpoint=endpoint,
                                   supported_versions=list(versions))
        self.registered = threading.Event()
        self.error = ""

    def GetInfo(self, request, context):
        return self.info

    def NotifyRegistrationStatus(self, request, context):
        if request.plugin_registered:
            self.error = ""
            self.registered.set()
            log.info("gpushard: the kubelet registered DRA driver %s", self.info.name)
        else:
            self.error = request.error
            self.registered.clear()
            log.error("gpushard: the kubelet refused DRA driver %s: %s", self.info.name, request.error)
        return rpb.RegistrationStatusResponse()


def add_health_services(servicer: resourcehealth.HealthServicer, server: grpc.Server) -> None:
    """NodeWatchResources under every name of HEALTH_SERVICES, the same messages on the wire."""
    handlers = {"NodeWatchResources": grpc.unary_stream_rpc_method_handler(
        servicer.NodeWatchResources, request_deserializer=hpb.NodeWatchResourcesRequest.FromString,
        response_serializer=hpb.NodeWatchResourcesResponse.SerializeToString)}
    for name in HEALTH_SERVICES:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


class DraPlugin:
    """The plugin's two sockets: the DRAPlugin service first, then the registration socket the kubelet watches.

    The kubelet dials us (registration is the plugin watcher's job), so there is no kubelet socket to
    wait for; ``step`` only serves a socket again when someone removed its file. With ``health``, the
    DRAResourceHealth service is served on the DRAPlugin's socket too, where the kubelet calls it.
    """

    def __init__(self, preparer: Preparer, registry_dir: str = REGISTRY_DIR, plugins_dir: str = PLUGINS_DIR,
                 driver: str = names.DRA_DRIVER, health: resourcehealth.HealthServicer | None = None) -> None:
        self.preparer = preparer
        self.driver = driver
        self.health = health
        self.endpoint = plugin_socket(plugins_dir, driver)
        self.registration = RegistrationServicer(driver, self.endpoint, health=health is not None)
        servicer = DraServicer(preparer)

        def add(server: grpc.Server) -> None:
            dpb_grpc.add_DRAPluginServicer_to_server(servicer, server)
            if health is not None:
                add_health_services(health, server)
        # Room for the health streams (each holds a worker for its life) beside prepare and unprepare.
        self._plugin = sockets.Server(self.endpoint, add, workers=4 + resourcehealth.MAX_STREAMS, name="dra")
        self._registry = sockets.Server(registration_socket(registry_dir, driver),
                                        lambda s: rpb_grpc.add_RegistrationServicer_to_server(self.registration, s),
                                        workers=2, name="dra-registration")

    @property
    def registration_path(self) -> str:
        return self._registry.path

    def sockets(self) -> list[sockets.Server]:
        return [self._plugin, self._registry]

    def unready(self) -> list[str]:
        """Why the kubelet cannot use the driver yet; empty once it took the registration."""
        if self.registration.registered.is_set():
            return []
        said = f" (it said: {self.registration.error})" if self.registration.error else ""
        return [f"the kubelet has not registered DRA driver {self.driver} yet{said}"]

    def start(self) -> None:
        # The specs of the claims prepared before, first: the kubelet may be starting their containers already.
        self.preparer.restore_specs()
        # Serve before announcing: the kubelet calls the endpoint as soon as it sees the registration socket.
        self._plugin.start()
        self._registry.start()

    def step(self) -> None:
        if not self._plugin.is_ours():
            log.info("gpushard: socket %s is gone; serving the DRA plugin again", self._plugin.path)
            self._plugin.start()
        if not self._registry.is_ours():
            log.info("gpushard: socket %s is gone; registering the DRA driver again", self._registry.path)
            self._registry.start()

    def run(self, stop: threading.Event, poll: float = 1.0) -> None:
        while not stop.is_set():
            try:
                self.step()
            except Exception:  # one bad poll must not end serving for good
                log.exception("gpushard: checking the DRA plugin sockets failed")
            stop.wait(poll)

    def stop(self) -> None:
        # The registration socket first, so the kubelet stops calling before the service goes; the health
        # streams end cleanly rather than cut off when the server stops.
        self._registry.stop()
        if self.health is not None:
            self.health.stop()
        self._plugin.stop()
