"""msjax: a JAX/XLA LLM training stack after MegaScale (Jiang et al., NSDI'24)."""

__version__ = "0.1.0"
