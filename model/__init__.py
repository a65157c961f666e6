"""Load, run and train the greenserve byte-level models (numpy + safetensors, no web imports)."""

__version__ = "0.1.0"
