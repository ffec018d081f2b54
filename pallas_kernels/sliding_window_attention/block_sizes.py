"""Tile sizes for the sliding-window flash-attention kernels, validated, with a per-device default table.

Legend: T sequence length, K head dim, W window (tokens a query sees, itself included).

Three kernels read these sizes (see kernel.py): the forward (`block_q` x `block_k` tiles), the dK/dV backward
(`block_q_dkv` x `block_k_dkv`) and the dQ backward (`block_q_dq` x `block_k_dq`). Each query block loops over
key blocks of its size; the loop bounds come from the window, so a smaller `block_k` skips more of the masked
region when W is small, and a larger one feeds the tensor cores bigger matmuls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Triton's tl.dot needs every matmul dimension >= 16; Mosaic TPU (splash) needs multiples of 128.
MIN_BLOCK = 16
TPU_BLOCK_MULTIPLE = 128
_BLOCK_FIELDS = ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes for the forward, dK/dV and dQ kernels (rows of queries x rows of keys per tile).

    Attributes:
      block_q, block_k: forward kernel tile (queries per program x keys per inner-loop step).
      block_q_dkv, block_k_dkv: dK/dV kernel tile (queries per inner-loop step x keys per program).
      block_q_dq, block_k_dq: dQ kernel tile (queries per program x keys per inner-loop step).
      num_warps: Triton warps per program; None lets the wrapper pick (4 for K <= 64, else 8, as jax's own
        Pallas attention does). Ignored by the TPU path.
      num_stages: Triton software-pipelining depth (>= 1). Ignored by the TPU path.

    Every block is a power of two >= 16 (Triton's matmul minimum and its power-of-two tensor shapes). The TPU
    (splash) path additionally needs multiples of 128; `validate_for_tpu` checks that.

    Raises:
      ValueError: naming the field, its value and what is allowed, when a block is not an int power of two
        >= 16, num_warps is not None or a power of two in [1, 32], or num_stages < 1.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 64
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in _BLOCK_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"BlockSizes.{name} must be an int, got {value!r} ({type(value).__name__})")
            if value < MIN_BLOCK or not _is_power_of_two(value):
                raise ValueError(
                    f"BlockSizes.{name}={value} is not allowed: blocks must be powers of two >= {MIN_BLOCK} "
                    f"(16, 32, 64, 128, ...)"
                )
        if self.num_warps is not None and (
            isinstance(self.num_warps, bool)
            or not isinstance(self.num_warps, int)
            or not _is_power_of_two(self.num_warps)
            or self.num_warps > 32
        ):
            raise ValueError(
                f"BlockSizes.num_warps={self.num_warps!r} is not allowed: use None or a power of two in [1, 32]"
            )
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages!r} is not allowed: use an int >= 1")

    def validate_for_tpu(self) -> None:
        """Raises ValueError naming the first block that is not a multiple of 128 (splash attention's tiling)."""
        for name in _BLOCK_FIELDS:
            value = getattr(self, name)
            if value % TPU_BLOCK_MULTIPLE:
                raise ValueError(
                    f"BlockSizes.{name}={value} is not allowed on TPU: splash attention needs multiples of "
                    f"{TPU_BLOCK_MULTIPLE} (128, 256, 512, ...)"
                )

    def replace(self, **changes) -> BlockSizes:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


# Default tiles per device family, keyed by a substring of `jax.Device.device_kind`, first match wins.
#
# NOT YET MEASURED ON HARDWARE: this session had no GPU or TPU. The values are starting points chosen from the
# FlashAttention-2 paper (Dao 2023, section 3.3: 64 or 128 rows per tile depending on head dim and shared memory)
# and from jax's own kernels (jax.experimental.pallas.ops.gpu.attention: 128 x 128 forward, 32-row backward tiles;
# splash attention: 128-multiples). Replace each entry with the winner of scripts/bench_attention.py on that
# device, and write the device, date and measured TFLOP/s next to it.
_DEFAULTS: tuple[tuple[str, BlockSizes], ...] = (
    # Hopper (H100/H200/H800, 228 KiB shared memory per SM). 128 x 64 bf16 tiles at K = 128 use
    # (128 + 2 * 2 * 64) * 128 * 2 B = 96 KiB with 2 pipeline stages.
    ("H100", BlockSizes(128, 64, 64, 128, 128, 64, num_warps=None, num_stages=2)),
    ("H200", BlockSizes(128, 64, 64, 128, 128, 64, num_warps=None, num_stages=2)),
    ("H800", BlockSizes(128, 64, 64, 128, 128, 64, num_warps=None, num_stages=2)),
    # Ampere (A100: 164 KiB shared memory per SM; A10/A40/A6000: 100 KiB). Same tiles as the FA2 paper's A100 runs.
    ("A100", BlockSizes(128, 64, 64, 128, 128, 64, num_warps=None, num_stages=2)),
    ("A800", BlockSizes(128, 64, 64, 128, 128, 64, num_warps=None, num_stages=2)),
    ("A10", BlockSizes(64, 64, 64, 64, 64, 64, num_warps=4, num_stages=2)),
    ("A40", BlockSizes(64, 64, 64, 64, 64, 64, num_warps=4, num_stages=2)),
    ("A6000", BlockSizes(64, 64, 64, 64, 64, 64, num_warps=4, num_stages=2)),
    # TPU (splash attention via kernel.py's wrapper): splash's own `BlockSizes.get_default()` is 128 everywhere;
    # 512-row query tiles are the usual choice on v4/v5 (fewer grid steps), not measured here.
    ("TPU", BlockSizes(512, 512, 512, 512, 512, 512)),
    # CPU runs the GPU kernel in Pallas interpret mode: only correctness matters; bigger tiles mean fewer
    # (slow, interpreted) grid steps.
    ("cpu", BlockSizes(64, 64, 64, 64, 64, 64)),
)
_FALLBACK = BlockSizes(64, 64, 64, 64, 64, 64)


def default_block_sizes(device_kind: str | None = None) -> BlockSizes:
    """The table entry for `device_kind` (default: `jax.devices()[0].device_kind`); 64-row tiles if unknown.

    Args:
      device_kind: e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite", "cpu". Matched by substring, case-sensitive
        for GPU model names, first match wins.

    Returns:
      A validated BlockSizes.
    """
    if device_kind is None:
        import jax

        device_kind = jax.devices()[0].device_kind
    for key, sizes in _DEFAULTS:
        if key in device_kind:
            return sizes
    return _FALLBACK
