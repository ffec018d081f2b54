"""Qwen3 8B's shape (Qwen team, "Qwen3 Technical Report", 2025, Table 1, and the released config.json): 36 layers,
width 4096, FFN 12288 (SwiGLU), 32 query heads over 8 key/value heads of 128, an RMSNorm over each query and key
head before RoPE, no biases, RMSNorm eps 1e-6, RoPE base 1,000,000, vocabulary 151,936 (untied), context 32,768;
8.19B parameters. For the planner (`scripts/plan.py --config=qwen3_8b`) and for fine-tuning a converted
checkpoint; the batch, optimizer and layout are Llama 3 8B's (the report does not publish its own), planned on 64 H100s.
"""

from .llama3_8b import OVERRIDES as LLAMA3_8B

OVERRIDES = {
    **LLAMA3_8B,
    "model.vocab_size": 151936,
    "model.num_layers": 36,
    "model.d_ff": 12288,
    "model.head_dim": 128,
    "model.max_seq_len": 32768,
    "model.rope_base": 1000000.0,
    "model.qk_norm": True,
    "model.norm_eps": 1e-6,
    "data.bpe_vocab_size": 151936,
    "train.run_dir": "runs/qwen3_8b",
}
