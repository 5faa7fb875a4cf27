"""Views of the cluster for card placement: from a static file, or live from the Kubernetes API."""
