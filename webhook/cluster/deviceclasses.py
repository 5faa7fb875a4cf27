"""The webhook's view of the cluster's DeviceClasses: which extended resources other drivers serve.

With DRAExtendedResource (Kubernetes 1.36+) a DeviceClass whose ``spec.extendedResourceName`` names a
resource makes the scheduler serve that resource from the class's driver; the core decides what that
means for a pod (``core/extended.py``). This module only keeps the classes current: a sink of one
``informing.Informer`` that lists DeviceClasses with the client's ``list_device_class`` and watches
them with the same call (``watch=True``), each class reduced to what it serves. A cluster without
``resource.k8s.io/v1`` (before 1.34) answers 404: the informer hands over an empty list, and asks
again now and then.

``served()`` never waits: it returns the immutable mapping built after the last change.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import kubernetes

from webhook import settings as settings_mod
from webhook.core import extended
from webhook.kubeapi import connecting, informing

log = logging.getLogger(__name__)

RESOURCE = informing.DEVICECLASSES


class DeviceClasses(informing.ByName[tuple[str, extended.Served]]):
    """The extended resources served by DeviceClasses other than gpushard's own, kept by list and watch."""

    def __init__(self, api_client: kubernetes.client.ApiClient | None, *,
                 watch_timeout: int = informing.WATCH_TIMEOUT_S, backoff: tuple[float, float] = informing.BACKOFF_S,
                 connect_timeout: float = informing.CONNECT_TIMEOUT_S, list_timeout: float = informing.LIST_TIMEOUT_S):
        calls = {RESOURCE: kubernetes.client.ResourceV1Api(api_client).list_device_class} \
            if api_client is not None else {}
        self.informer = informing.Informer(api_client, self, watch_timeout=watch_timeout, backoff=backoff,
                                           resources=(RESOURCE,), connect_timeout=connect_timeout,
                                           list_timeout=list_timeout, calls=calls)
        super().__init__()  # class name -> (resource, who serves it)
        self._served: Mapping[str, extended.Served] = extended.NONE

    @classmethod
    def start(cls, settings: settings_mod.Settings | None = None,
              api_client: kubernetes.client.ApiClient | None = None, **options) -> DeviceClasses:
        """The classes of the API server (in-cluster, else kubeconfig) with the watch running; its timeouts
        from the config's ``view``, as the cluster view's (``options`` override them, for tests)."""
        settings = settings or settings_mod.Settings()
        options = {"connect_timeout": settings.view.connect_timeout, "list_timeout": settings.view.list_timeout,
                   "watch_timeout": settings.view.watch_timeout, **options}
        classes = cls(api_client if api_client is not None else _default_api_client(), **options)
        classes.informer.start()
        return classes

    def served(self) -> Mapping[str, extended.Served]:
        """Resource name -> who serves it, as of the last list or event (empty before the first list)."""
        return self._served

    def synced(self) -> bool:
        return self.listed

    def close(self) -> None:
        self.informer.close()

    # --- the sink (informing.ByName): each class as extended.read_class reads it ------------------

    def read(self, obj: dict) -> tuple[str, extended.Served] | None:
        return extended.read_class(obj)

    def rebuild(self) -> None:
        served = extended.winners(self._by_name.values())
        if served != dict(self._served):
            log.info("gpushard: DeviceClasses of other drivers serve %s", ", ".join(
                f"{resource} ({by.device_class})" for resource, by in sorted(served.items())) or "no extended resource")
        self._served = extended.frozen(served)


def _default_api_client() -> kubernetes.client.ApiClient | None:
    try:
        return connecting.client().api
    except connecting.ConfigError as exc:
        log.error("%s; the webhook does not see which extended resources DeviceClasses serve", exc)
        return None


class Fixed:
    """Classes that never change: a cluster file's (``static.load_file``), for `gpushard serve --cluster`."""

    def __init__(self, served: Mapping[str, extended.Served]):
        self._served = extended.frozen(dict(served))

    def served(self) -> Mapping[str, extended.Served]:
        return self._served

    def synced(self) -> bool:
        return True

    def close(self) -> None:
        pass
