"""KiloLine: a self-hosted gateway that turns bursts into an orderly lease queue in front of GPUs."""

__version__ = "0.1.0"
