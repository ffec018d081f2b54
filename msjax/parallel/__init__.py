"""Parallelism that the compiler's sharding propagation does not write for us.

This package owns two subsystems. Nothing is imported here, so importing one module does not pull in the others.

Pipeline parallelism:
  schedule          the interleaved-1F1B tick table the pipelined step runs, its bubble and microbatches in flight
                    (pure Python, so the planner prices the same numbers).
  schedules         1F1B, interleaved 1F1B, ZB-H1 and ZB-V as tables of forward, input-gradient and weight-gradient
                    passes per stage and tick, with their bubble and activations in flight (pure Python).
  split_backward    a layer's backward as two passes, input gradient (B) and weight gradients (W), through the
                    model's weight-matmul point: what a zero-bubble schedule defers.
  pipeline          the pipelined gradient computation inside the one jitted train step, `shard_map` over the
                    `pipeline` mesh axis. The layout and memory check run before anything is allocated lives with
                    the planner (`msjax.planner.preflight`).

Communication hidden behind compute:
  options           the active overlap switches (`mesh.tp_overlap`, `mesh.fsdp_prefetch`) for traced code, set
                    by the train step next to the sharding rules; it applies the transforms they select to the
                    model (`msjax.sharding.use_parallelism`).
  collective_matmul Megatron-SP's all-gather -> matmul and matmul -> reduce-scatter decomposed into bidirectional
                    `ppermute` steps under `jax.shard_map`, one all-gather and one reduce-scatter per parallel
                    block (MegaScale Fig. 3).
  fsdp_prefetch     layer i+1's FSDP parameter all-gather carried through the layer scan ahead of layer i.
  zero2             ZeRO-2's gradient reduction written out: `psum_scatter` over `fsdp` under `jax.shard_map`.
  expert            expert parallelism: a mixture of experts' tokens sent to the devices holding their experts and
                    back by all-to-all under `jax.shard_map`, each device running only its own experts.
  arrival           per-device timestamps inside the step (its start, the backward's end) for the straggler
                    detector of `msjax.observe`.
  xla_flags         XLA flag presets per backend, applied before the backend starts.

The model stays single-device code that names its axes and never imports this package: these transforms reach it
through the five points it declares (`msjax.sharding.Parallelism`), and nothing here changes the math
(tests/msjax/test_pipeline.py, tests/msjax/test_overlap.py). Context-parallel attention, an attention
implementation over a sequence-sharded mesh, is `msjax.ops.context_parallel`.
"""
