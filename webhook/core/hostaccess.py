"""Host access that reaches cards around the device plugin: what a pod in an enforce namespace may not ask.

A container that is privileged, holds CAP_SYS_ADMIN, shares the node's PID namespace, mounts
/dev, the kubelet's folders or the toolkit's device-list folder, or carries an annotation
that makes the runtime inject devices or mounts, can see cards that no share was counted for, however
the device plugin and the env name its card. Each is a finding that names the container and
the field; enforce mode denies them, audit mode reports them. What the operator trusts
(``policy.exempt``) is left alone.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from webhook.core import asks as req
from webhook.core import findings as f
from webhook.core import names
from webhook.core.policy import Policy

# Every container list of a pod spec, with the word a message uses for its containers.
CONTAINER_LISTS = (("initContainers", "init container"), ("containers", "container"),
                   ("ephemeralContainers", "ephemeral container"))
DEFAULT_SERVICE_ACCOUNT = "default"
RULES = frozenset({f.PRIVILEGED, f.ADDED_CAPABILITIES, f.HOST_PID, f.HOST_PATH, f.DEVICE_LIST_MOUNT,
                   f.DEVICE_ANNOTATION, f.VISIBLE_DEVICES_FROM})


def _dict(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _deny(rule: str, message: str, container: str | None = None) -> f.Finding:
    return f.Finding(rule, f.DENY, message, container)


def service_account(spec: dict) -> str:
    """The pod's service account as the API server defaults it."""
    for key in ("serviceAccountName", "serviceAccount"):
        value = spec.get(key)
        if isinstance(value, str) and value:
            return value
    return DEFAULT_SERVICE_ACCOUNT


def exempt(spec: dict, namespace: str, policy: Policy) -> bool:
    trusted = policy.exempt
    if not trusted.namespaces and not trusted.service_accounts:
        return False  # the default: nobody is trusted, and no service account needs reading
    return trusted.covers(namespace, service_account(spec))


def normal_path(path: object) -> str | None:
    """An absolute path with '..', '.' and repeated '/' resolved, as the node would; None if no text."""
    if not isinstance(path, str) or not path:
        return None
    # The kubelet runs from "/", so a relative hostPath is one below it.
    cleaned = posixpath.normpath("/" + path)
    return "/" + cleaned.lstrip("/")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _exposed(path: str) -> str | None:
    """What a hostPath of ``path`` exposes around the device plugin, or None."""
    for root in names.HOST_DEVICE_PATHS:
        if _under(path, root):
            return _what(root)
        if _under(root, path):  # a parent: a subPath reaches the folder below it
            return f"a folder holding {root}"
    return None


def _what(root: str) -> str:
    if root == "/dev":
        return "the node's device files"
    if root in ("/proc", "/sys"):
        return "the node's processes and kernel controls"
    if root == "/var/lib/kubelet":
        return "the kubelet's folders (device-plugin sockets, pod-resources)"
    if root in names.DEVICE_LIST_MOUNT_ROOTS:
        return "the toolkit's device-list folder"
    return f"{root}, which the container runtime, the NVIDIA toolkit or gpushard's agent uses"


def injecting_family(key: str) -> str | None:
    """The device- or mount-injecting annotation family ``key`` belongs to, or None.

    Matched as the runtimes and their plugins look keys up: exactly, case and all (the
    ValidatingAdmissionPolicy deploy/base/device-channels.yaml matches the same list the same way).
    """
    for family in names.INJECTING_ANNOTATION_FAMILIES:
        if key == family or key.startswith(family + "/"):
            return family
    return None


def _container(container: dict, label: str, where: str, debug_may_add: tuple[str, ...] = ()) -> list[f.Finding]:
    name = str(container.get("name") or "")
    found = []
    security = _dict(container.get("securityContext"))
    if security.get("privileged") is True:
        found.append(_deny(f.PRIVILEGED, (
            f"gpushard: {label} \"{name}\" is privileged ({where}.securityContext.privileged), "
            "so it would see every card of the node"), name))
    added = _list(_dict(security.get("capabilities")).get("add"))
    for cap in added:
        text = str(cap).strip().upper().removeprefix("CAP_")
        if text in names.BASELINE_CAPABILITIES or text in debug_may_add:
            continue
        allowed = "beyond Pod Security's baseline"
        if debug_may_add:
            allowed += f" and what a debug container may add here ({', '.join(debug_may_add)})"
        found.append(_deny(f.ADDED_CAPABILITIES, (
            f"gpushard: {label} \"{name}\" adds capability {cap} ({where}.securityContext.capabilities.add), "
            f"{allowed}, so it could reach the node's devices"), name))
    for i, mount in enumerate(_list(container.get("volumeMounts"))):
        mount = _dict(mount)
        path = normal_path(mount.get("mountPath"))
        # The toolkit matches the bare prefix: ".../nvidia-container-devicesall" names "all".
        if path is not None and path.startswith(names.DEVICE_LIST_MOUNT_ROOTS):
            found.append(_deny(f.DEVICE_LIST_MOUNT, (
                f"gpushard: {label} \"{name}\" mounts volume \"{mount.get('name')}\" at {path} "
                f"({where}.volumeMounts[{i}].mountPath), the toolkit's device-list folder"), name))
    return found


def container_findings(spec: dict, where: str, only: Iterable[tuple[str, int]] | None = None) -> list[f.Finding]:
    """Findings about each container (or only the (list, position) pairs in ``only``)."""
    chosen = set(only) if only is not None else None
    # A debug container acts in the pod's own namespaces; in a pod on the node's network namespace the network
    # capabilities would act on the node's, so there it may add only SYS_PTRACE.
    debug_may_add = tuple(c for c in names.DEBUG_CAPABILITIES
                          if not (spec.get("hostNetwork") is True and c in names.HOST_NETWORK_CAPABILITIES))
    found = []
    for key, label in CONTAINER_LISTS:
        items = spec.get(key)
        if not isinstance(items, list):
            continue
        for i, container in enumerate(items):
            # Only a security context or a mount can hold a finding: skip the rest without a look.
            if (isinstance(container, dict) and (chosen is None or (key, i) in chosen)
                    and (container.get("securityContext") is not None or container.get("volumeMounts") is not None)):
                found += _container(container, label, f"{where}.{key}[{i}]",
                                    debug_may_add if key == "ephemeralContainers" else ())
    return found


def _allowed_host_path(path: str, policy: Policy) -> bool:
    return any(_under(path, allowed) for allowed in policy.exempt.host_paths)


def _volumes(spec: dict, where: str, policy: Policy) -> list[f.Finding]:
    """hostPath volumes: none unless the operator allows the path, and never one around the device plugin.

    Pod Security's baseline allows no hostPath at all; a list of dangerous folders would always miss
    one (a runtime's socket, a symlink through /proc/1/root), so the default is none.
    """
    found = []
    for i, volume in enumerate(_list(spec.get("volumes"))):
        volume = _dict(volume)
        host = volume.get("hostPath")
        if host is None:
            continue
        raw = _dict(host).get("path")
        path = normal_path(raw)
        field = f"{where}.volumes[{i}].hostPath.path"
        exposed = _exposed(path) if path is not None else None
        if exposed:
            found.append(_deny(f.HOST_PATH, (
                f"gpushard: volume \"{volume.get('name')}\" is hostPath {path} ({field}), which exposes {exposed}")))
        elif path is None or not _allowed_host_path(path, policy):
            found.append(_deny(f.HOST_PATH, (
                f"gpushard: volume \"{volume.get('name')}\" is hostPath {path or repr(raw)} ({field}); pods here "
                "mount only host paths the operator allows (policy.exempt.hostPaths)")))
    return found


def _annotations(annotations: dict, where: str) -> list[f.Finding]:
    found = []
    for key in sorted(map(str, annotations)):
        family = injecting_family(key)
        if family is None:
            continue
        what = "mounts" if family in names.MOUNT_ANNOTATION_FAMILIES else "devices"
        found.append(_deny(f.DEVICE_ANNOTATION, (
            f"gpushard: annotation \"{key}\" ({where}) makes the container runtime inject {what} "
            f"(the {family} family, whatever its value)")))
    return found


def _env_from(spec: dict, asks: list[req.ContainerAsk], where: str) -> list[f.Finding]:
    """envFrom in a passthrough container: gpushard removes its own env entry, so this would win."""
    found = []
    for ask in asks:
        if not ask.passthrough:
            continue
        container = spec[ask.list_key][ask.position]
        for i, source in enumerate(_list(container.get("envFrom"))):
            source = _dict(source)
            prefix = source.get("prefix") or ""
            if isinstance(prefix, str) and not names.VISIBLE_DEVICES_ENV.startswith(prefix):
                continue
            ref = next((f"{kind[:-3]} \"{_dict(source[kind]).get('name')}\"" for kind in ("configMapRef", "secretRef")
                        if kind in source), "a source")
            shown = f" with prefix \"{prefix}\"" if prefix else ""
            found.append(_deny(f.VISIBLE_DEVICES_FROM, (
                f"gpushard: container \"{ask.name}\" takes env from {ref}{shown} "
                f"({where}.{ask.list_key}[{ask.position}].envFrom[{i}]), which could set "
                f"{names.VISIBLE_DEVICES_ENV} over NVIDIA's plugin's value"), ask.name))
    return found


def pod_findings(spec: dict, annotations: object, where: str, annotations_where: str, namespace: str,
                 asks: list[req.ContainerAsk], policy: Policy) -> list[f.Finding]:
    """Every host-access finding of a Pod's or a template's pod spec (none when it is exempt)."""
    if exempt(spec, namespace, policy):
        return []
    found = []
    if spec.get("hostPID") is True:
        found.append(_deny(f.HOST_PID, (
            f"gpushard: the pod shares the node's process namespace ({where}.hostPID), "
            "so it could reach other pods' cards through their processes")))
    # Most pods have no volumes, annotations or passthrough containers: each check below is
    # skipped on one look when there is nothing for it to see.
    if spec.get("volumes") is not None:
        found += _volumes(spec, where, policy)
    if isinstance(annotations, dict) and annotations:
        found += _annotations(annotations, annotations_where)
    found += container_findings(spec, where)
    for ask in asks:
        if ask.passthrough:
            found += _env_from(spec, asks, where)
            break
    return found


def added_ephemeral(spec: dict, old_spec: dict | None) -> list[int]:
    """Positions of the ephemeral containers that an UPDATE adds (by name: names are unique in a pod)."""
    before = {c.get("name") for c in _list((old_spec or {}).get("ephemeralContainers")) if isinstance(c, dict)}
    return [i for i, c in enumerate(_list(spec.get("ephemeralContainers")))
            if isinstance(c, dict) and c.get("name") not in before]


def ephemeral_findings(spec: dict, added: list[int], namespace: str, policy: Policy) -> list[f.Finding]:
    """Host-access findings of the debug containers an UPDATE adds to a running pod."""
    if exempt(spec, namespace, policy):
        return []
    return container_findings(spec, "spec", [("ephemeralContainers", i) for i in added])
