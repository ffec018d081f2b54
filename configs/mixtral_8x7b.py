"""Mixtral 8x7B's shape (Jiang et al. 2024, "Mixtral of Experts", Table 1, and the released config.json): Mistral
7B's attention (32 layers, width 4096, 32 query heads over 8 key/value heads, RoPE base 1,000,000, vocabulary 32,000
untied, context 32,768, no sliding window) with every feed-forward a mixture of 8 SwiGLU experts of width 14336,
each token routed to 2 (softmax, top-2, renormalised); 46.7B parameters, 12.9B active per token. For fine-tuning a
converted checkpoint (`scripts/convert.py --from_hf`); the batch, optimizer and layout are Llama 3 8B's (the paper
does not publish its own); the planner prices it (docs/planner.md, "Mixture of experts").
"""

from .llama3_8b import OVERRIDES as LLAMA3_8B

OVERRIDES = {
    **LLAMA3_8B,
    "model.vocab_size": 32000,
    "model.max_seq_len": 32768,
    "model.rope_base": 1000000.0,
    "model.moe.num_experts": 8,
    "model.moe.expert_ff": 14336,
    "model.moe.aux_loss_coef": 0.02,  # the released config's router_aux_loss_coef
    "data.bpe_vocab_size": 32000,
    "train.run_dir": "runs/mixtral_8x7b",
}
