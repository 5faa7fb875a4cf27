"""gpushard: fractional GPUs on Kubernetes, one pod to one physical card."""

__version__ = "0.1.0"
