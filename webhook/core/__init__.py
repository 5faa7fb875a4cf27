"""The pure domain of gpushard: standard library only, no I/O, no clock, no environment."""
