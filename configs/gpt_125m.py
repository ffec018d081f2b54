"""GPT-3 Small (Brown et al. 2020, Table 2.1): 12 layers, width 768, 12 heads, context 2048."""

OVERRIDES = {
    "model.vocab_size": 50257,
    "model.num_layers": 12,
    "model.d_model": 768,
    "model.num_heads": 12,
    "model.max_seq_len": 2048,
    "data.bpe_vocab_size": 50257,
    "train.seq_len": 2048,
    "train.global_batch": 256,
    "optimizer.lr": 6e-4,
    "optimizer.min_lr": 6e-5,
    "optimizer.b2": 0.95,
    "optimizer.warmup_steps": 2000,
    "train.steps": 300000,
    "train.run_dir": "runs/gpt_125m",
}
