"""The CPU-sized Llama-style model: gpt_tiny's size and recipe with Llama's blocks (RoPE, RMSNorm, SwiGLU, 6 query
heads over 2 key/value heads, no biases, untied output projection) on the default corpus (the interpreter's
standard-library sources, byte-level BPE). Sized so that a 2-core CPU shows validation loss falling within a few
minutes (docs/models.md has the measured run).
"""

OVERRIDES = {
    "model.scan_layers": False,  # shallow: a Python loop over layers beats scan ~2x in the backward on CPU
    "model.d_model": 192,
    "model.num_heads": 6,
    "model.num_kv_heads": 2,
    "model.d_ff": 512,  # ~8/3 d_model: SwiGLU's three matrices hold what GeLU's two of 4 d_model would
    "model.max_seq_len": 128,
    "model.position": "rope",
    "model.norm": "rmsnorm",
    "model.mlp": "swiglu",
    "model.use_bias": False,
    "model.tie_embeddings": False,
    "train.seq_len": 128,
    "train.eval_batches": 10,
    "train.run_dir": "runs/llama_tiny",
    "optimizer.lr": 2e-3,
    "optimizer.min_lr": 2e-4,
    "optimizer.warmup_steps": 50,
    "checkpoint.every": 250,
}
