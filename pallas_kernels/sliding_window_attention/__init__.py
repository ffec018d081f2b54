"""Causal sliding-window flash attention (forward + backward) for GPU (Pallas Triton) and TPU (splash)."""

from .block_sizes import BlockSizes, default_block_sizes
from .ops import sliding_window_attention
from .reference import sliding_window_attention_reference

__all__ = ["BlockSizes", "default_block_sizes", "sliding_window_attention", "sliding_window_attention_reference"]
