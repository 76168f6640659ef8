"""moe-runtime: the program every inference pod runs (probe, inspect, serve, make-checkpoint)."""

__version__ = "0.1.0"
