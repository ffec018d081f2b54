"""Llama 3 8B's shape (Meta, "The Llama 3 Herd of Models", 2024, Table 3): 32 layers, width 4096, FFN 14336
(SwiGLU), 32 query heads over 8 key/value heads, RoPE base 500,000, vocabulary 128,256 (128K BPE + special
tokens, untied output projection), context 8192, peak learning rate 3e-4 (AdamW, beta2 0.95). For the planner
(`scripts/plan.py --config=llama3_8b`) and for continuing a converted checkpoint (docs/models.md); the batch is
2048 sequences of 8192 tokens (16.8M tokens per step) and the layout tensor 8 x FSDP over the rest (planned on 64
H100s: `--devices=64 --hardware=h100 --mesh.tensor=8`).
"""

OVERRIDES = {
    "model.vocab_size": 128256,
    "model.num_layers": 32,
    "model.d_model": 4096,
    "model.num_heads": 32,
    "model.num_kv_heads": 8,
    "model.d_ff": 14336,
    "model.max_seq_len": 8192,
    "model.position": "rope",
    "model.rope_base": 500000.0,
    "model.norm": "rmsnorm",
    "model.mlp": "swiglu",
    "model.use_bias": False,
    "model.tie_embeddings": False,
    "model.dtype": "bfloat16",
    "model.remat": "full",
    "data.bpe_vocab_size": 128256,
    "mesh.tensor": 8,
    "optimizer.lr": 3e-4,
    "optimizer.min_lr": 3e-6,
    "optimizer.b2": 0.95,
    "optimizer.warmup_steps": 2000,
    "train.seq_len": 8192,
    "train.global_batch": 2048,
    "train.steps": 100000,
    "train.run_dir": "runs/llama3_8b",
}
