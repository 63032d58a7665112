"""keras_boost's version (setup.py says the same)."""

__version__ = "0.1.0"
