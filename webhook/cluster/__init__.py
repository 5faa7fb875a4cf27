"""Views of the cluster for card placement: from a static file, or live from the Kubernetes API.

Every view offers the same small surface, which the admission server relies on:
``snapshot() -> placement.View | None`` (None: no view yet), ``synced() -> bool``,
``remember(node, card, shares)`` (a non-dry-run placement the view cannot know of yet),
and ``close()``.
"""

from __future__ import annotations


def open_view(cluster_file: str | None, shares_per_card: int, settings=None):
    """The static view of ``cluster_file``, or, without one, the live view of the Kubernetes API."""
    if cluster_file is not None:
        from webhook.cluster import static

        return static.StaticView(static.load(cluster_file, shares_per_card))
    from webhook.cluster import kube

    return kube.KubeView.start(settings)
