"""Pallas kernels for msjax: one folder per op (ops.py public API + custom_vjp, kernel.py pallas_call bodies,
reference.py plain-JAX twin, block_sizes.py validated tiles). msjax imports this package, never the reverse."""
