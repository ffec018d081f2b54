"""Benchmark causal sliding-window attention: Pallas kernels vs cuDNN, windowed and full causal.

For each sequence length T and window W: forward and forward+backward wall time (median of --iters timed calls
after --warmup untimed ones, each ended by block_until_ready) and achieved TFLOP/s, for
  pallas         msjax's Pallas kernels, window W
  pallas_causal  the same kernels, window None (full causal flash attention)
  cudnn          jax.nn.dot_product_attention(is_causal=True, local_window_size=(W-1, 0), implementation="cudnn")
  cudnn_causal   the same, no window
With --smoke (CPU, seconds): tiny shapes, the Pallas kernels in interpret mode, and implementation="xla" in place
of cuDNN; the timings are then meaningless, the point is that every path runs.

FLOP count (useful work, window-aware, FlashAttention-2 convention):
  forward          = 4 * B * H * K * P,  P = sum_{i=1..T} min(i, W)  (visible query-key pairs; W = T if None)
  forward+backward = 3.5 * forward       (the backward has 5 matmuls to the forward's 2; recomputation of S in the
                                          backward is not counted, as in the FA2 paper)
Masked-out pairs are not counted even when a kernel computes them, so a kernel that wastes work on masked tiles
shows a lower TFLOP/s.

Usage:
  python scripts/bench_attention.py --json bench.json             # GPU
  python scripts/bench_attention.py --smoke --json /tmp/smoke.json  # CPU check
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp


from msjax import cli, runtime
from msjax.pallas_kernels.sliding_window_attention import sliding_window_attention
from msjax.pallas_kernels.sliding_window_attention.kernel import visible_pairs

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()


def attention_flops(batch: int, heads: int, head_dim: int, seq_len: int, window: int | None) -> tuple[int, int]:
    """(forward, forward+backward) useful FLOPs; see the module docstring for the formula."""
    forward = 4 * batch * heads * head_dim * visible_pairs(seq_len, window)
    return forward, int(3.5 * forward)


def make_impl(name: str, window: int | None, smoke: bool):
    """A function (q, k, v) -> out for implementation `name`."""
    if name.startswith("pallas"):
        w = None if name == "pallas_causal" else window
        backend = "cpu" if smoke else None
        return lambda q, k, v: sliding_window_attention(q, k, v, window=w, backend=backend)
    implementation = "xla" if smoke else "cudnn"
    w = None if name.endswith("_causal") else window
    local = None if w is None else (w - 1, 0)
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=local, implementation=implementation
    )


def time_fn(fn, args, warmup: int, iters: int) -> float:
    """Median wall time of fn(*args) in seconds (each call waited on with block_until_ready)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_one(name, batch, seq_len, window, heads, kv_heads, head_dim, dtype, warmup, iters, smoke):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq_len, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), dtype)
    do = jax.random.normal(keys[3], (batch, seq_len, heads, head_dim), dtype)
    attn = make_impl(name, window, smoke)
    forward = jax.jit(attn)
    forward_backward = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
    counted_window = None if name.endswith("_causal") else window
    flops_fwd, flops_fwd_bwd = attention_flops(batch, heads, head_dim, seq_len, counted_window)
    row = {
        "impl": name, "batch": batch, "seq_len": seq_len, "window": counted_window, "heads": heads,
        "kv_heads": kv_heads, "head_dim": head_dim, "dtype": jnp.dtype(dtype).name,
        "flops_fwd": flops_fwd, "flops_fwd_bwd": flops_fwd_bwd,
    }
    try:
        t_fwd = time_fn(forward, (q, k, v), warmup, iters)
        t_fwd_bwd = time_fn(forward_backward, (q, k, v, do), warmup, iters)
    except Exception as e:  # noqa: BLE001 - a benchmark reports a failing implementation and moves on
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    row.update(
        fwd_s=t_fwd, fwd_bwd_s=t_fwd_bwd,
        fwd_tflops=flops_fwd / t_fwd / 1e12, fwd_bwd_tflops=flops_fwd_bwd / t_fwd_bwd / 1e12,
    )
    return row


@dataclasses.dataclass(frozen=True)
class AttentionBenchOptions:
    """bench_attention.py's flags.

    Attributes:
      smoke: tiny CPU run: interpret mode, xla instead of cudnn.
      json: write the rows here.
      seq_lens: comma-separated sequence lengths T.
      windows: comma-separated window sizes W.
      heads: query heads H.
      kv_heads: key/value heads (0: --heads, no GQA).
      head_dim: head dimension K.
      tokens: tokens per call; batch = max(1, tokens // T).
      dtype: input dtype (bfloat16, float16, float32).
      impls: comma-separated implementations (pallas, cudnn, pallas_causal, cudnn_causal).
      warmup: untimed calls before timing.
      iters: timed calls (the median is reported).
    """

    smoke: bool = False
    json: str = ""
    seq_lens: str = "4096,8192,32768"
    windows: str = "512,4096"
    heads: int = 32
    kv_heads: int = 0
    head_dim: int = 128
    tokens: int = 131072
    dtype: str = "bfloat16"
    impls: str = "pallas,cudnn,pallas_causal,cudnn_causal"
    warmup: int = 3
    iters: int = 10


def main(argv=None) -> int:
    return cli.main_guard(lambda: _main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    common, opts = cli.parse_options(argv, AttentionBenchOptions(), prog="bench_attention.py",
                                     description=__doc__)
    cli.setup_logging(common)
    if opts.json:
        cli.check_writable(opts.json, "--json")
    args = types.SimpleNamespace(**dataclasses.asdict(opts))
    if args.smoke:
        args.seq_lens, args.windows, args.heads, args.head_dim, args.tokens = "256", "64", 2, 32, 256
        args.warmup, args.iters = 1, 2
        args.impls = args.impls.replace("cudnn", "xla")
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    windows = [int(x) for x in args.windows.split(",")]
    impls = args.impls.split(",")
    kv_heads = args.kv_heads or args.heads
    dtype = jnp.dtype(args.dtype)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"H={args.heads} Hkv={kv_heads} K={args.head_dim} {dtype.name}, median of {args.iters}")

    rows = []
    header = f"{'impl':<14}{'T':>7}{'W':>7}{'B':>5}{'fwd ms':>10}{'fwd TF/s':>10}{'f+b ms':>10}{'f+b TF/s':>10}"
    print(header)
    print("-" * len(header))
    for seq_len in seq_lens:
        batch = max(1, args.tokens // seq_len)
        for window in windows:
            for name in impls:
                if name.endswith("_causal") and window != windows[0]:
                    continue  # the causal baselines do not depend on W: time them once per T
                row = bench_one(name, batch, seq_len, window, args.heads, kv_heads, args.head_dim, dtype,
                                args.warmup, args.iters, args.smoke)
                rows.append(row)
                w = "-" if row["window"] is None else row["window"]
                if "error" in row:
                    print(f"{name:<14}{seq_len:>7}{w:>7}{batch:>5}  {row['error']}")
                else:
                    print(f"{name:<14}{seq_len:>7}{w:>7}{batch:>5}{row['fwd_s'] * 1e3:>10.3f}"
                          f"{row['fwd_tflops']:>10.3f}{row['fwd_bwd_s'] * 1e3:>10.3f}{row['fwd_bwd_tflops']:>10.3f}")
    meta = {"device_kind": device.device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
            "smoke": args.smoke, "warmup": args.warmup, "iters": args.iters,
            "flops": "fwd = 4*B*H*K*sum_i min(i, W); fwd+bwd = 3.5*fwd"}
    result = {"meta": meta, "rows": rows}
    print(json.dumps(result))  # the one JSON line every benchmark ends with (scripts/README.md)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
