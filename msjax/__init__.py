"""msjax: a JAX/XLA LLM training stack after MegaScale (Jiang et al., NSDI'24).

Importing msjax or any of its modules changes no process-wide state: the process set-up (malloc tuning on CPU,
jax's compilation cache, XLA:CPU's collective safety flags) is `msjax.runtime.setup()`, which the entry points
that start a run call first (the train and launch commands, the benchmarks, `msjax.train.run`, the notebook).
"""

__version__ = "0.1.0"
