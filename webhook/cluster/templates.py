"""Making sure a namespace has the ResourceClaimTemplate a pod's claim comes from (backend dra).

The pod names ``gpushard-shares-<n>`` (``gpushard-shares-<n>-mib-<size>`` for a memory ask sized for cards
of ``size`` MiB); Kubernetes' resourceclaim controller makes the pod's claim
from it once the pod exists, and while the template is missing it records a
``FailedResourceClaimCreation`` event on the pod and tries again with backoff: the pod stays
Pending, then starts normally once the template appears. So the webhook makes the template as it
admits the first such pod of a namespace, before answering, and remembers which exist for a
minute; after that the next such pod has a background pass make sure of it again (a template
deleted since, with its namespace made again, comes back within a few seconds), and that pod is
answered at once: only the first pod of a namespace and share count waits for an API call, where a
check on the admission path every minute and size made about one admission in fifty wait for one
in a burst (docs/notes/costs.md). When the API server does not take a new template in time, the pod is
still admitted with a warning, and the background pass keeps trying.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import kubernetes

from webhook.core import draobjects, names

log = logging.getLogger(__name__)

GROUP, VERSION = names.DRA_API_VERSION.split("/")
PLURAL = "resourceclaimtemplates"


class Templates:
    """Ensures templates exist; thread-safe, one API call per namespace and share count at most once."""

    def __init__(self, api: kubernetes.client.ApiClient, timeout: float = 2.0, retry: float = 5.0,
                 recheck: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.timeout = timeout
        self.retry = retry
        # A template is remembered this long: a namespace deleted and made again, or a template someone
        # deleted, gets it back from the next pod after that (its pods wait until then).
        self.recheck = recheck
        self.clock = clock
        self._known: dict[tuple[str, int, int], float] = {}  # -> when it was last made sure of
        self._pending: set[tuple[str, int, int]] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _make(self, namespace: str, shares: int, size_mib: int = 0) -> None:
        obj = draobjects.claim_template(namespace, shares, size_mib=size_mib)
        problems = draobjects.check_claim_template(obj)
        if problems:
            raise ValueError("; ".join(problems))
        try:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, obj,
                                                        _request_timeout=self.timeout)
        except kubernetes.client.exceptions.ApiException as exc:
            if exc.status != 409:  # 409: it exists (another replica, or an operator, made it)
                raise
        log.info("gpushard: ResourceClaimTemplate %s/%s is there", namespace, obj["metadata"]["name"])

    def ensure(self, namespace: str, shares: int, size_mib: int = 0) -> str | None:
        """Make sure the template exists; a warning for the pod when that could not be made sure.
        ``size_mib``: the card size a memory ask's shares were computed for (0: any card)."""
        key = (namespace, shares, size_mib)
        with self._lock:
            seen = self._known.get(key)
            if seen is not None:
                if self.clock() - seen >= self.recheck and key not in self._pending:
                    # Made before: checked again in the background, not on this pod's admission.
                    self._pending.add(key)
                    self._wake.set()
                return None
        return self._make_sure(key)

    def _make_sure(self, key: tuple[str, int, int]) -> str | None:
        namespace, shares, size_mib = key
        try:
            self._make(namespace, shares, size_mib)
        except Exception as exc:
            with self._lock:
                self._pending.add(key)
            self._wake.set()
            reason = f"HTTP {exc.status}" if isinstance(exc, kubernetes.client.exceptions.ApiException) else \
                type(exc).__name__
            log.warning("gpushard: cannot make ResourceClaimTemplate %s/%s yet (%s); will retry", namespace,
                        draobjects.template_name(shares, size_mib), exc)
            return (f"gpushard: template {namespace}/{draobjects.template_name(shares, size_mib)} not made yet "
                    f"({reason}); "
                    "the pod waits until it is")
        with self._lock:
            self._known[key] = self.clock()
            self._pending.discard(key)
        return None

    def retry_pending(self) -> None:
        with self._lock:
            pending = sorted(self._pending)
        for key in pending:
            self._make_sure(key)

    def start(self) -> Templates:
        def loop():
            while not self._stop.is_set():
                self._wake.wait(self.retry)
                self._wake.clear()
                if self._stop.wait(self.retry):
                    return
                self.retry_pending()

        self._thread = threading.Thread(target=loop, name="gpushard-templates", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
