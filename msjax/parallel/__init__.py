"""Parallelism that the compiler's sharding propagation does not write for us.

This package owns the pipeline schedule (`schedule`: the interleaved-1F1B tick table, its bubble and
microbatches in flight, pure Python so the planner prices the same numbers; `pipeline`: the pipelined gradient
computation inside the one jitted train step, `shard_map` over the `pipeline` mesh axis). The layout and memory
check run before anything is allocated lives with the planner (`msjax.planner.preflight`). Collective matmul
and XLA flag presets join it as their own modules. Nothing is imported here, so importing one module does not
pull in the others.
"""
