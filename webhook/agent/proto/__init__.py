"""Stubs generated from deviceplugin.proto (the kubelet device-plugin API v1beta1); regenerate with `make proto`."""
