"""The CPU-sized mixture of experts: llama_tiny's blocks and recipe with every feed-forward a mixture of 8 SwiGLU
experts, each token routed to 2 (softmax then top-2, renormalised: Mixtral's router), dropless, with the
load-balancing (0.01) and z (0.001) losses. Each expert is a quarter of llama_tiny's MLP, so a token's active
feed-forward (2 experts) is half of llama_tiny's and the layer's total (8 experts) twice it. On the default corpus
(the interpreter's standard-library sources, byte-level BPE); a 2-core CPU runs it in minutes.
"""

from .llama_tiny import OVERRIDES as LLAMA_TINY

OVERRIDES = {
    **LLAMA_TINY,
    "model.moe.num_experts": 8,
    "model.moe.expert_ff": 128,
    "train.run_dir": "runs/moe_tiny",
}
