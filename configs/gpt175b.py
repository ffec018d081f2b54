"""MegaScale's 175B (Jiang et al., NSDI'24, sec. 6): 96 layers, hidden 12288, 128 heads, sequence 2048,
vocabulary 64,000, LAMB, parallel transformer blocks; TP 8 x PP 8 with the rest data parallel, batch 6144.
"""

OVERRIDES = {
    "model.vocab_size": 64000,
    "model.num_layers": 96,
    "model.d_model": 12288,
    "model.num_heads": 128,
    "model.max_seq_len": 2048,
    "model.block": "parallel",
    "model.dtype": "bfloat16",
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
