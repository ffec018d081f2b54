"""Qwen3-30B-A3B's shape (Qwen team, "Qwen3 Technical Report", 2025, Table 2, and the released config.json): 48
layers, width 2048, 32 query heads over 4 key/value heads of 128 with an RMSNorm over each before RoPE, every
feed-forward a mixture of 128 SwiGLU experts of width 768, each token routed to 8 (softmax, top-8, renormalised),
no shared expert, RMSNorm eps 1e-6, RoPE base 1,000,000, vocabulary 151,936 (untied), context 32,768; 30.5B
parameters, 3.3B active per token. For fine-tuning a converted checkpoint (`scripts/convert.py --from_hf`); the
batch and optimizer are Llama 3 8B's (the report does not publish its own), tensor parallelism 4 (its key/value
heads); the planner prices it (docs/planner.md, "Mixture of experts").
"""

from .llama3_8b import OVERRIDES as LLAMA3_8B

OVERRIDES = {
    **LLAMA3_8B,
    "model.vocab_size": 151936,
    "model.num_layers": 48,
    "model.d_model": 2048,
    "model.num_kv_heads": 4,
    "mesh.tensor": 4,  # its 4 key/value heads split over at most 4
    "model.head_dim": 128,
    "model.d_ff": 6144,  # the released config's intermediate_size (no dense layer uses it)
    "model.max_seq_len": 32768,
    "model.rope_base": 1000000.0,
    "model.qk_norm": True,
    "model.norm_eps": 1e-6,
    "model.moe.num_experts": 128,
    "model.moe.experts_per_token": 8,
    "model.moe.expert_ff": 768,
    "data.bpe_vocab_size": 151936,
    "train.run_dir": "runs/qwen3_30b_a3b",
}
