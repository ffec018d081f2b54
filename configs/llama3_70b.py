"""Llama 3 70B's shape (Meta, "The Llama 3 Herd of Models", 2024, Table 3): 80 layers, width 8192, FFN 28672
(SwiGLU), 64 query heads over 8 key/value heads, RoPE base 500,000, vocabulary 128,256 (untied), context 8192,
peak learning rate 1.5e-4 (AdamW, beta2 0.95). For the planner (`scripts/plan.py --config=llama3_70b`); the batch
is 2048 sequences of 8192 tokens and the layout tensor 8 x pipeline 4 (20 layers a stage) x FSDP over the rest
(planned on 512 H100s: `--devices=512 --hardware=h100 --mesh.tensor=8 --mesh.pipeline=4`).
"""

from .llama3_8b import OVERRIDES as LLAMA3_8B

# Llama 3 8B's family settings (RoPE base, RMSNorm, SwiGLU, 8 key/value heads, vocabulary, context, AdamW betas),
# at 70B's size.
OVERRIDES = {
    **LLAMA3_8B,
    "model.num_layers": 80,
    "model.d_model": 8192,
    "model.num_heads": 64,
    "model.d_ff": 28672,
    "mesh.pipeline": 4,
    "optimizer.lr": 1.5e-4,
    "optimizer.min_lr": 1.5e-6,
    "train.run_dir": "runs/llama3_70b",
}
