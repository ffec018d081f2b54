"""msjax: a JAX/XLA LLM training stack after MegaScale (Jiang et al., NSDI'24)."""

__version__ = "0.1.0"

from msjax import runtime as _runtime  # noqa: E402

# Before anything imports and runs jax: glibc malloc tuning and the persistent compilation cache (msjax/runtime.py).
_runtime.setup()
