"""GPT-3 13B (Brown et al. 2020, Table 2.1): 40 layers, width 5120, 40 heads, context 2048."""

OVERRIDES = {
    "model.vocab_size": 50257,
    "model.num_layers": 40,
    "model.d_model": 5120,
    "model.num_heads": 40,
    "model.max_seq_len": 2048,
    "model.dtype": "bfloat16",
    "model.remat": "full",
    "data.bpe_vocab_size": 50257,
    "mesh.tensor": 8,
    "train.seq_len": 2048,
    "train.global_batch": 1024,
    "optimizer.lr": 1e-4,
    "optimizer.min_lr": 1e-5,
    "optimizer.b2": 0.95,
    "optimizer.warmup_steps": 2000,
    "train.steps": 300000,
    "train.run_dir": "runs/gpt_13b",
}
