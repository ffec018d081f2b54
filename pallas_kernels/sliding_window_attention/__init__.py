"""Causal sliding-window flash attention (forward + backward) for GPU (Pallas Triton) and TPU (splash)."""

from pallas_kernels.sliding_window_attention.block_sizes import BlockSizes, default_block_sizes
from pallas_kernels.sliding_window_attention.ops import sliding_window_attention
from pallas_kernels.sliding_window_attention.reference import sliding_window_attention_reference

__all__ = ["BlockSizes", "default_block_sizes", "sliding_window_attention", "sliding_window_attention_reference"]
