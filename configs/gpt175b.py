"""MegaScale's 175B (Jiang et al., NSDI'24, sec. 6): 96 layers, hidden 12288, 128 heads, sequence 2048,
vocabulary 64,000, LAMB, parallel transformer blocks; TP 8 x PP 8 with the rest data parallel, batch 6144.

Remat `dots_no_batch` (the weight matmuls' outputs are kept, norms, GeLU and attention recomputed): the
cheapest policy with which the smallest job of this shape, one pipeline of TP 8 x PP 8 on 64 devices (no data
parallelism to shard the optimizer state over), fits 80 GB devices. `python scripts/plan.py --config=gpt175b
--devices=64 --mesh.tensor=8 --mesh.pipeline=8` lists the total by remat policy (none does not fit: the stash
of every layer's activations; dots_no_batch is 66 GiB by the compiled step, docs/planner.md); on 12,288 GPUs the
policy costs 0.5 MFU points against none (55.5% against 56.0%: `--model.remat=none` there).
"""

OVERRIDES = {
    "model.vocab_size": 64000,
    "model.num_layers": 96,
    "model.d_model": 12288,
    "model.num_heads": 128,
    "model.max_seq_len": 2048,
    "model.block": "parallel",
    "model.dtype": "bfloat16",
    "model.remat": "dots_no_batch",
    "data.bpe_vocab_size": 64000,
    "mesh.tensor": 8,
    "mesh.pipeline": 8,
    "optimizer.name": "lamb",
    "optimizer.lr": 6e-4,
    "optimizer.min_lr": 6e-5,
    "optimizer.b2": 0.95,
    "optimizer.warmup_steps": 2000,
    "train.seq_len": 2048,
    "train.global_batch": 6144,
    "train.steps": 100000,
    "train.run_dir": "runs/gpt175b",
}
