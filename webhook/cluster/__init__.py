"""Views of the cluster for card placement: from a static file, or live from the Kubernetes API.

Every view offers the same small surface, which the admission server relies on:
``snapshot() -> placement.View | None`` (None: no view yet), ``synced() -> bool``,
``remember(node, card, shares)`` (a non-dry-run placement the view cannot know of yet),
and ``close()``.
"""

from __future__ import annotations

import os


def open_view(cluster_file: str | None, shares_per_card: int, settings=None, after_list=None):
    """The static view of ``cluster_file``, or, without one, the live view of the Kubernetes API (calling
    ``after_list`` after each of its complete lists)."""
    if cluster_file is not None:
        from webhook.cluster import static

        return static.StaticView(static.load(cluster_file, shares_per_card))
    from webhook.cluster import kube

    return kube.KubeView.start(settings, after_list=after_list)


def open_device_classes(cluster_file: str | None, shares_per_card: int, settings=None):
    """What DeviceClasses of other drivers serve: ``cluster_file``'s ``deviceClasses``, or, without one, the
    Kubernetes API's, kept by list and watch. Either offers ``served()``, ``synced()`` and ``close()``."""
    from webhook.cluster import deviceclasses

    if cluster_file is not None:
        from webhook.cluster import static

        return deviceclasses.Fixed(static.load_file(cluster_file, shares_per_card)[1])
    return deviceclasses.DeviceClasses.start(settings)


def open_peers(cluster_file: str | None, settings=None):
    """Which replica this is, for its share of the cards: ``$GPUSHARD_REPLICA`` (``serve --replica``), else,
    with the Kubernetes API and in a pod, its rank among the webhook Service's ready pods; split among the
    replica's workers by ``$GPUSHARD_WORKER``. Offers ``share()``."""
    from webhook.cluster import peers

    if cluster_file is not None:
        fixed = os.environ.get(peers.REPLICA_ENV)
        return peers.for_worker(peers.Fixed(peers.parse(fixed, f"${peers.REPLICA_ENV}") if fixed else None))
    return peers.for_worker(peers.Peers.start(settings))


def open_templates(settings):
    """With backend dra, what makes sure each namespace has the claim templates its pods name; else None."""
    if settings is None or settings.policy.backend != "dra":
        return None
    from webhook.cluster import templates
    from webhook.kubeapi import connecting

    return templates.Templates(connecting.client().api).start()
