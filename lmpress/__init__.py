"""lmpress: compress LLMs, export them, and gate them on quality against the baseline."""

__version__ = "0.1.0"
