"""The one config file shared by webhook and agent, validated once, with errors naming the key."""

from __future__ import annotations

import math
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from webhook.core import policy as policy_mod
from webhook.core import runtimes

VERSION = "v1"
MAX_SHARES_PER_CARD = 1000
# An extended resource name: a DNS subdomain prefix, "/", a name part.
_RESOURCE = re.compile(r"^(?=.{1,253}/)[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
# A RuntimeClass name: a DNS-1123 subdomain.
_RUNTIME_CLASS = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*)?$")
# policy.newNodeCards: more cards than any GPU node has is a typo.
MAX_NEW_NODE_CARDS = 64
# policy.newNodeCardMemoryMiB: 1 TiB, beyond any GPU's memory.
MAX_NEW_NODE_CARD_MIB = 1 << 20


# The keys of each section of the file (docs/config.md); any other is refused by name.
POLICY_KEYS = frozenset({"wholeCards", "multiCard", "placement", "nodeAffinity", "hideUnrequestedGpus", "exempt",
                         "runtimeClassName", "memorySize", "newNodeCards", "newNodeCardMemoryMiB"})
VIEW_KEYS = frozenset({"connectTimeout", "listTimeout", "watchTimeout"})
AGENT_KEYS = frozenset({"requestTimeout", "metricsRequestTimeout", "runtimeCDI"})
REPLACEMENT_KEYS = frozenset({"enabled", "pendingSeconds", "interval", "cleanupRefused"})


class SettingsError(ValueError):
    """A config file gpushard cannot run with; the message names the key."""


@dataclass(frozen=True)
class Replacement:
    """`gpushard replace`: evict pinned pods waiting on a full card while another card has room."""

    enabled: bool = True
    pending_seconds: int = 0  # how long a pod waits before gpushard re-places it (0: once provably stranded)
    interval: int = 5  # seconds between passes
    # Delete, through the Eviction API, the pods the kubelet refused at admission (core/refusals.py) that a
    # controller makes again; off, the replacer only records an Event on each. A bare pod is never deleted.
    cleanup_refused: bool = False


@dataclass(frozen=True)
class View:
    """The webhook's live view of the cluster: how long its requests to the API server may take, in seconds."""

    connect_timeout: float = 10.0  # to open a connection, for a list or a watch
    list_timeout: float = 120.0  # to read each page of a list
    watch_timeout: int = 300  # how long each watch lasts, asked of the API server; the read gives up 30 s later


@dataclass(frozen=True)
class Agent:
    """The node agent's requests to the API server, in seconds each."""

    request_timeout: float = 10.0  # its Node's inventory, ResourceSlices, the claims and pods it prepares
    # TokenReview, SubjectAccessReview and the node's pods, made while a scrape waits: well under
    # Prometheus's default scrape timeout of 10 s.
    metrics_request_timeout: float = 5.0
    # Whether the node's container runtime applies CDI devices (backend dra needs it): "auto" reads it from the
    # runtime version the Node reports (webhook.core.runtimes); "true" or "false" is the operator's word.
    runtime_cdi: str = "auto"


@dataclass(frozen=True)
class Settings:
    policy: policy_mod.Policy = field(default_factory=policy_mod.Policy)
    source: str = "<defaults>"
    replacement: Replacement = field(default_factory=Replacement)
    view: View = field(default_factory=View)
    agent: Agent = field(default_factory=Agent)


def _check_keys(where: str, data: dict, allowed: set[str] | frozenset[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise SettingsError(f"{where}{unknown[0]}: unknown key (expected one of {', '.join(sorted(allowed))})")


def _mapping(key: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SettingsError(f"{key}: must be a mapping, got {value!r}")
    return value


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SettingsError(f"{key}: must be one of {', '.join(choices)}, got {value!r}")
    return value


# A namespace or ServiceAccount name: a DNS label (namespaces) or subdomain (service accounts).
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_ACCOUNT = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _names(key: str, value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise SettingsError(f"{key}: must be a list of names, got {value!r}")
    return value


def _exempt(value: Any) -> policy_mod.Exempt:
    """policy.exempt: what is trusted with host access in enforce namespaces."""
    ex = _mapping("policy.exempt", value)
    _check_keys("policy.exempt.", ex, {"serviceAccounts", "namespaces", "hostPaths"})
    namespaces = _names("policy.exempt.namespaces", ex.get("namespaces"))
    for name in namespaces:
        if not _NAMESPACE.match(name):
            raise SettingsError(f"policy.exempt.namespaces: {name!r} is not a namespace name")
    accounts = _names("policy.exempt.serviceAccounts", ex.get("serviceAccounts"))
    for entry in accounts:
        namespace, _, account = entry.partition("/")
        if not _NAMESPACE.match(namespace) or not _ACCOUNT.match(account):
            raise SettingsError(f"policy.exempt.serviceAccounts: {entry!r} is not namespace/name")
    host_paths = _names("policy.exempt.hostPaths", ex.get("hostPaths"))
    for path in host_paths:
        if not path.startswith("/") or "\x00" in path:
            raise SettingsError(f"policy.exempt.hostPaths: {path!r} is not an absolute path")
    return policy_mod.Exempt(service_accounts=frozenset(accounts), namespaces=frozenset(namespaces),
                             host_paths=tuple("/" + posixpath.normpath(p).lstrip("/") for p in host_paths))


def _device_list_strategy(value: Any) -> tuple[str, ...]:
    """deviceListStrategy: one name or a list of them, as NVIDIA's device plugin takes it."""
    if value is None:
        return policy_mod.DEFAULT_DEVICE_LIST_STRATEGY
    listed = [value] if isinstance(value, str) else value
    if not isinstance(listed, list) or not listed:
        raise SettingsError(f"deviceListStrategy: must be a non-empty list of "
                            f"{', '.join(policy_mod.DEVICE_LIST_STRATEGIES)}, got {value!r}")
    for name in listed:
        _choice("deviceListStrategy", name, policy_mod.DEVICE_LIST_STRATEGIES)
    if len(set(listed)) != len(listed):
        raise SettingsError(f"deviceListStrategy: lists a strategy twice: {value!r}")
    return tuple(listed)


def from_mapping(data: Any, source: str = "<mapping>") -> Settings:
    """Validate a parsed config document."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SettingsError(f"{source}: the config must be a mapping, got {type(data).__name__}")
    _check_keys("", data, {"version", "sharesPerCard", "resources", "policy", "deviceListStrategy", "isolation",
                           "replacement", "backend", "view", "agent"})
    version = data.get("version", VERSION)
    if version != VERSION:
        raise SettingsError(f"version: must be {VERSION!r}, got {version!r}")

    spc = data.get("sharesPerCard", 100)
    if isinstance(spc, bool) or not isinstance(spc, int) or not 1 <= spc <= MAX_SHARES_PER_CARD:
        raise SettingsError(f"sharesPerCard: must be an integer from 1 to {MAX_SHARES_PER_CARD}, got {spc!r}")

    res = _mapping("resources", data.get("resources"))
    _check_keys("resources.", res, {"fraction", "shares", "cardPrefix", "memory"})
    defaults = policy_mod.Resources()
    fraction = res.get("fraction", defaults.fraction)
    shares = res.get("shares", defaults.shares)
    prefix = res.get("cardPrefix", defaults.card_prefix)
    memory = res.get("memory", defaults.memory)
    for key, value, pattern in (("fraction", fraction, _RESOURCE), ("shares", shares, _RESOURCE),
                                ("cardPrefix", prefix, _PREFIX), ("memory", memory, _RESOURCE)):
        # The kubelet takes anything in the kubernetes.io domain (or a subdomain) as a native resource.
        if not isinstance(value, str) or not pattern.match(value) or "kubernetes.io/" in value \
                or value.startswith("requests."):
            raise SettingsError(f"resources.{key}: {value!r} is not an extended resource name (domain/name)")
    if len({fraction, shares}) < 2 or shares.startswith(prefix) or fraction.startswith(prefix):
        raise SettingsError("resources: fraction, shares and cardPrefix must name different resources")
    if memory in (fraction, shares) or memory.startswith(prefix):
        raise SettingsError(f"resources.memory: {memory!r} must differ from fraction, shares and cardPrefix")

    pol = _mapping("policy", data.get("policy"))
    _check_keys("policy.", pol, POLICY_KEYS)
    hide = pol.get("hideUnrequestedGpus", True)
    if not isinstance(hide, bool):
        raise SettingsError(f"policy.hideUnrequestedGpus: must be true or false, got {hide!r}")
    runtime_class = pol.get("runtimeClassName") or None  # "" and null both mean "leave pods alone"
    if runtime_class is not None and (not isinstance(runtime_class, str) or not _RUNTIME_CLASS.match(runtime_class)):
        raise SettingsError(f"policy.runtimeClassName: {runtime_class!r} is not a RuntimeClass name "
                            "(lower-case DNS subdomain, such as nvidia)")
    new_cards = pol.get("newNodeCards", 0)
    if isinstance(new_cards, bool) or not isinstance(new_cards, int) or not 0 <= new_cards <= MAX_NEW_NODE_CARDS:
        raise SettingsError(f"policy.newNodeCards: must be a whole number of cards from 0 to {MAX_NEW_NODE_CARDS} "
                            f"(the cards of a node the autoscaler adds; 0: none), got {new_cards!r}")
    new_mib = pol.get("newNodeCardMemoryMiB", 0)
    if isinstance(new_mib, bool) or not isinstance(new_mib, int) or not 0 <= new_mib <= MAX_NEW_NODE_CARD_MIB:
        raise SettingsError(f"policy.newNodeCardMemoryMiB: must be a whole number of MiB from 0 to "
                            f"{MAX_NEW_NODE_CARD_MIB} (each card's memory on a node the autoscaler adds, as its "
                            f"label gpushard.io/card-<k>.memory-mib says; 0: unknown), got {new_mib!r}")
    if new_mib and not new_cards:
        raise SettingsError(f"policy.newNodeCardMemoryMiB: {new_mib} is set but policy.newNodeCards is 0; set "
                            "newNodeCards to the cards of a node the autoscaler adds, or newNodeCardMemoryMiB to 0")
    policy = policy_mod.Policy(
        shares_per_card=spc,
        resources=policy_mod.Resources(fraction=fraction, shares=shares, card_prefix=prefix, memory=memory),
        whole_cards=_choice("policy.wholeCards", pol.get("wholeCards", "share"), policy_mod.WHOLE_CARDS),
        multi_card=_choice("policy.multiCard", pol.get("multiCard", "deny"), policy_mod.MULTI_CARD),
        placement=_choice("policy.placement", pol.get("placement", "binpack"), policy_mod.PLACEMENTS),
        node_affinity=_choice("policy.nodeAffinity", pol.get("nodeAffinity", "preferred"), policy_mod.NODE_AFFINITIES),
        hide_unrequested_gpus=hide,
        exempt=_exempt(pol.get("exempt")),
        device_list_strategy=_device_list_strategy(data.get("deviceListStrategy")),
        isolation=_choice("isolation", data.get("isolation", "none"), policy_mod.ISOLATIONS),
        runtime_class_name=runtime_class,
        backend=_choice("backend", data.get("backend", policy_mod.DEVICEPLUGIN), policy_mod.BACKENDS),
        memory_size=_choice("policy.memorySize", pol.get("memorySize", "smallest"), policy_mod.MEMORY_SIZES),
        new_node_cards=new_cards,
        new_node_card_memory_mib=new_mib,
    )
    return Settings(policy=policy, source=source, replacement=_replacement(data.get("replacement")),
                    view=_view(data.get("view")), agent=_agent(data.get("agent")))


def _seconds(key: str, value: Any, integer: bool = False) -> float:
    """A timeout: a number of seconds above 0 (an integer where the API server takes only those)."""
    if integer:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SettingsError(f"{key}: must be a whole number of seconds, 1 or more, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SettingsError(f"{key}: must be a number of seconds above 0, got {value!r}")
    return float(value)


def _view(value: Any) -> View:
    data = _mapping("view", value)
    _check_keys("view.", data, VIEW_KEYS)
    defaults = View()
    return View(connect_timeout=_seconds("view.connectTimeout", data.get("connectTimeout", defaults.connect_timeout)),
                list_timeout=_seconds("view.listTimeout", data.get("listTimeout", defaults.list_timeout)),
                watch_timeout=int(_seconds("view.watchTimeout", data.get("watchTimeout", defaults.watch_timeout),
                                           integer=True)))


def _agent(value: Any) -> Agent:
    data = _mapping("agent", value)
    _check_keys("agent.", data, AGENT_KEYS)
    defaults = Agent()
    runtime_cdi = data.get("runtimeCDI", defaults.runtime_cdi)
    # YAML reads true and false as booleans; "auto" stays a string.
    if isinstance(runtime_cdi, bool):
        runtime_cdi = "true" if runtime_cdi else "false"
    if runtime_cdi not in runtimes.DECLARED:
        raise SettingsError(f"agent.runtimeCDI: must be auto, true or false, got {runtime_cdi!r}")
    return Agent(request_timeout=_seconds("agent.requestTimeout", data.get("requestTimeout", defaults.request_timeout)),
                 metrics_request_timeout=_seconds("agent.metricsRequestTimeout",
                                                  data.get("metricsRequestTimeout", defaults.metrics_request_timeout)),
                 runtime_cdi=runtime_cdi)


def _replacement(value: Any) -> Replacement:
    data = _mapping("replacement", value)
    _check_keys("replacement.", data, REPLACEMENT_KEYS)
    defaults = Replacement()
    switches = {}
    for key, default in (("enabled", defaults.enabled), ("cleanupRefused", defaults.cleanup_refused)):
        switches[key] = data.get(key, default)
        if not isinstance(switches[key], bool):
            raise SettingsError(f"replacement.{key}: must be true or false, got {switches[key]!r}")
    numbers = {}
    for key, seconds, low in (("pendingSeconds", defaults.pending_seconds, 0), ("interval", defaults.interval, 1)):
        number = data.get(key, seconds)
        if isinstance(number, bool) or not isinstance(number, int) or number < low:
            raise SettingsError(f"replacement.{key}: must be an integer of seconds >= {low}, got {number!r}")
        numbers[key] = number
    return Replacement(switches["enabled"], numbers["pendingSeconds"], numbers["interval"],
                       cleanup_refused=switches["cleanupRefused"])


def read_yaml(path: Path, what: str, error: type[Exception], formats: str = "YAML") -> object:
    """One YAML (or JSON) document from a file; ``error`` names the file and what went wrong.

    Shared by every file gpushard reads at start: config, cluster view, card inventory.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read the {what}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: the {what} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                    f"{exc.start})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid {formats}: {exc}") from None


def load(path: str | Path | None) -> Settings:
    """Read and validate the config file; ``None`` gives the defaults."""
    if path is None:
        return Settings()
    path = Path(path)
    data = read_yaml(path, "config file", SettingsError)
    try:
        return from_mapping(data, source=str(path))
    except SettingsError as exc:
        message = str(exc)
        raise SettingsError(message if message.startswith(f"{path}:") else f"{path}: {message}") from None
