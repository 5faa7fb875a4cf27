"""The node agent, in four rooms (the kubelet keeps its device manager and its DRA manager apart the same way):

- ``node``: what either backend stands on: the cards through NVML and their health, MPS and each container's
  limits, the Node's inventory and the operator's cordons, the toolkit check, other device plugins and other
  DRA drivers on the node, PodResources, and the unix-socket gRPC server;
- ``deviceplugin``: the kubelet device-plugin backend (its servers, their registration, the node-wide
  resource's holders);
- ``dra``: the DRA backend (the kubelet plugin, its ResourceSlice, CDI specs, resource health, the Node's count);
- ``metrics``: the agent's /metrics.

``running`` picks one backend and starts the rooms. ``deviceplugin`` and ``dra`` never import each other;
``node`` imports neither, nor ``metrics`` (tests/test_layers.py).
"""
