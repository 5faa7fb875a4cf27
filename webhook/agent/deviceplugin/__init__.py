"""The kubelet device-plugin backend: a gRPC server per resource, registered with the kubelet."""
