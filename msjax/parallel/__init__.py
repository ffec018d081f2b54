"""Parallel execution beyond what the rule sets express: communication hidden behind compute.

This package owns (overlap subsystem, issue 10):
  options           the active overlap switches (`mesh.tp_overlap`, `mesh.fsdp_prefetch`) for traced code, set
                    by the train step next to the sharding rules.
  collective_matmul Megatron-SP's all-gather -> matmul and matmul -> reduce-scatter decomposed into bidirectional
                    `ppermute` steps under `jax.shard_map`, one all-gather and one reduce-scatter per parallel
                    block (MegaScale Fig. 3).
  context_parallel  the key/value all-gather over `sequence` whose transpose is a reduce-scatter of dK/dV.
  fsdp_prefetch     layer i+1's FSDP parameter all-gather carried through the layer scan ahead of layer i.
  xla_flags         XLA flag presets per backend, applied before the backend starts.

The model stays single-device code that names its axes: it calls into this package at two dispatch points
(`Block.__call__` and the layer scan), and nothing here changes the math (tests/msjax/test_overlap.py).
"""
