"""Qwen2.5 7B's shape (Qwen team, "Qwen2.5 Technical Report", 2024, Table 1, and the released config.json): 28
layers, width 3584, FFN 18944 (SwiGLU), 28 query heads over 4 key/value heads, biases on the q/k/v projections
alone, RMSNorm (eps 1e-6), RoPE base 1,000,000, vocabulary 152,064 (untied), context 32,768; 7.62B parameters.
For the planner (`scripts/plan.py --config=qwen2_5_7b`) and for fine-tuning a converted checkpoint; the batch,
optimizer and layout are Llama 3 8B's (the report does not publish its own), planned on 64 H100s.
"""

from .llama3_8b import OVERRIDES as LLAMA3_8B

OVERRIDES = {
    **LLAMA3_8B,
    "model.vocab_size": 152064,
    "model.num_layers": 28,
    "model.d_model": 3584,
    "model.num_heads": 28,
    "model.num_kv_heads": 4,
    "model.d_ff": 18944,
    "model.max_seq_len": 32768,
    "model.rope_base": 1000000.0,
    "model.qkv_bias": True,
    "model.norm_eps": 1e-6,
    "data.bpe_vocab_size": 152064,
    "mesh.tensor": 4,
    "train.run_dir": "runs/qwen2_5_7b",
}
