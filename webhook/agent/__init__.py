"""The node agent: NVML in, the kubelet device-plugin API and the Node's inventory out."""
