"""The CPU-sized mixture of experts: llama_tiny's blocks and recipe with every feed-forward a mixture of 8 SwiGLU
experts, each token routed to 2 (softmax then top-2, renormalised: Mixtral's router), dropless, with the
load-balancing (0.01) and z (0.001) losses. Each expert is a quarter of llama_tiny's MLP, so a token's active
feed-forward (2 experts) is half of llama_tiny's and the layer's total (8 experts) twice it. On the default corpus
(the interpreter's standard-library sources, byte-level BPE); a 2-core CPU runs it in minutes.
"""

OVERRIDES = {
    "model.scan_layers": False,  # shallow: a Python loop over layers beats scan in the backward on CPU
    "model.d_model": 192,
    "model.num_heads": 6,
    "model.num_kv_heads": 2,
    "model.d_ff": 512,
    "model.max_seq_len": 128,
    "model.position": "rope",
    "model.norm": "rmsnorm",
    "model.mlp": "swiglu",
    "model.use_bias": False,
    "model.tie_embeddings": False,
    "model.moe.num_experts": 8,
    "model.moe.expert_ff": 128,
    "train.seq_len": 128,
    "train.eval_batches": 10,
    "train.run_dir": "runs/moe_tiny",
    "optimizer.lr": 2e-3,
    "optimizer.min_lr": 2e-4,
    "optimizer.warmup_steps": 50,
    "checkpoint.every": 250,
}
