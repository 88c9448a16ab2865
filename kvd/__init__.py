"""kvd: the KV-cache daemon of a prefix-caching LLM serving system."""

__version__ = "0.1.0"
