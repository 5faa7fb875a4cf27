"""The DRA backend: the kubelet plugin of driver gpu.gpushard.io, its ResourceSlice and CDI specs."""
