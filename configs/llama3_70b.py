"""Llama 3 70B's shape (Meta, "The Llama 3 Herd of Models", 2024, Table 3): 80 layers, width 8192, FFN 28672
(SwiGLU), 64 query heads over 8 key/value heads, RoPE base 500,000, vocabulary 128,256 (untied), context 8192,
peak learning rate 1.5e-4 (AdamW, beta2 0.95). For the planner (`scripts/plan.py --config=llama3_70b`); the batch
is 2048 sequences of 8192 tokens and the layout tensor 8 x pipeline 4 (20 layers a stage) x FSDP over the rest.
"""

OVERRIDES = {
    "model.vocab_size": 128256,
    "model.num_layers": 80,
    "model.d_model": 8192,
    "model.num_heads": 64,
    "model.num_kv_heads": 8,
    "model.d_ff": 28672,
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
    "mesh.pipeline": 4,
    "optimizer.lr": 1.5e-4,
    "optimizer.min_lr": 1.5e-6,
    "optimizer.b2": 0.95,
    "optimizer.warmup_steps": 2000,
    "train.seq_len": 8192,
    "train.global_batch": 2048,
    "train.steps": 100000,
    "train.run_dir": "runs/llama3_70b",
}
