"""Mistral 7B's shape (Jiang et al. 2023, "Mistral 7B", Table 1, and v0.1's released config.json): 32 layers, width
4096, FFN 14336 (SwiGLU), 32 query heads over 8 key/value heads, sliding-window attention of 4096 tokens, RoPE base
10,000, vocabulary 32,000 (untied), context 32,768; 7.24B parameters. Later releases (v0.2, v0.3) drop the window:
`--model.attention.window=None`. For the planner (`scripts/plan.py --config=mistral_7b`) and for fine-tuning a
converted checkpoint; the batch, optimizer and layout are Llama 3 8B's (the paper does not publish its own),
planned on 64 H100s.
"""

from .llama3_8b import OVERRIDES as LLAMA3_8B

# Llama 3 8B's without its RoPE base: Mistral keeps the default 10,000.
OVERRIDES = {
    **{k: v for k, v in LLAMA3_8B.items() if k != "model.rope_base"},
    "model.vocab_size": 32000,
    "model.max_seq_len": 32768,
    "model.attention.window": 4096,
    "data.bpe_vocab_size": 32000,
    "train.run_dir": "runs/mistral_7b",
}
