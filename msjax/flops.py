"""Model FLOPs per token, the numerator of MFU.

Formula (Kaplan et al. 2020, sec. 2.1; PaLM, Chowdhery et al. 2022, appendix B):
    training FLOPs per token = 6 * N + 6 * L * (2 * H * K) * k_bar
where N counts the parameters that take part in matmuls (every weight matrix: attention's Q, K, V and output
projections, the MLP's two matrices (GeLU) or three (SwiGLU: gate, up, down), and the output projection onto the
vocabulary once, tied to the token embedding or not: the input embedding is a lookup, not a matmul), excluding
position embeddings, norms and biases, L layers, H query heads of
size K, and k_bar the mean number of keys a query attends. PaLM writes the attention term as 12 * L * H * K * T
for full (non-causal) attention; we count the keys actually attended, so it is window-aware: with causal
attention and window W over sequence T, k_bar = (1/T) * sum_{i=1..T} min(i, W). For dense causal attention
this is (T + 1) / 2 (the FlashAttention convention); `megatron_convention=True` uses k_bar = T as Megatron-LM's
MFU formula does (Narayanan et al. 2021, eq. 3), for comparing with published figures.
Remat recompute is not counted: MFU counts model FLOPs, not hardware FLOPs. Element-wise work is not counted either
(norms, LayerNorm or RMSNorm; activations; RoPE's rotation, ~6 FLOPs per query/key element), as in the papers
above: it is O(D) per token against the matmuls' O(D^2). tests/msjax/test_flops.py checks N against the matmuls
of the traced forward and backward programs.
"""

from __future__ import annotations


def mean_attended_keys(seq_len: int, window: int | None, megatron_convention: bool = False) -> float:
    """k_bar: mean number of keys per query for causal attention with an optional sliding window."""
    if megatron_convention:
        return float(seq_len if window is None else min(window, seq_len))
    w = seq_len if window is None else min(window, seq_len)
    # sum_{i=1..T} min(i, W) = W(W+1)/2 + (T - W) W
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def matmul_params(model_cfg, vocab_size: int | None = None) -> int:
    """N: parameters in matmuls (weights of attention, the MLP (2 matrices for GeLU, 3 for SwiGLU) and the
    vocabulary projection over the padded vocabulary)."""
    m = model_cfg
    d, h, kv, k, f = m.d_model, m.num_heads, m.kv_heads, m.head_size, m.ff_size
    v = m.padded_vocab(vocab_size)
    mlp_matrices = 3 if m.mlp == "swiglu" else 2
    per_layer = d * h * k + 2 * d * kv * k + h * k * d + mlp_matrices * d * f
    return m.num_layers * per_layer + v * d


def flops_per_token(model_cfg, seq_len: int, vocab_size: int | None = None,
                    megatron_convention: bool = False) -> float:
    """Training (forward + backward) model FLOPs per token; see the module docstring for the formula."""
    m = model_cfg
    k_bar = mean_attended_keys(seq_len, m.attention.window, megatron_convention)
    return 6.0 * matmul_params(m, vocab_size) + 12.0 * m.num_layers * m.num_heads * m.head_size * k_bar
