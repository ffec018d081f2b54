"""GPT-3 XL shape class (Brown et al. 2020, Table 2.1): 24 layers, width 2048, context 2048; 16 heads of 128."""

OVERRIDES = {
    "model.vocab_size": 50257,
    "model.num_layers": 24,
    "model.d_model": 2048,
    "model.num_heads": 16,
    "model.max_seq_len": 2048,
    "model.dtype": "bfloat16",
    "model.remat": "dots",
    "data.bpe_vocab_size": 50257,
    "train.seq_len": 2048,
    "train.global_batch": 512,
    "optimizer.lr": 2e-4,
    "optimizer.min_lr": 2e-5,
    "optimizer.b2": 0.95,
    "optimizer.warmup_steps": 2000,
    "train.steps": 300000,
    "train.run_dir": "runs/gpt_1_3b",
}
