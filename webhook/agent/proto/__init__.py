"""Stubs generated from our .proto files for the kubelet's gRPC APIs; regenerate with `make proto`."""
