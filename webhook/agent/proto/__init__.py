"""Stubs generated from deviceplugin.proto (device plugins, v1beta1) and podresources.proto (PodResources, v1); regenerate with `make proto`."""
