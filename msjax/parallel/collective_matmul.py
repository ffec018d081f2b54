"""Collective matmul: Megatron-SP's all-gather and reduce-scatter decomposed into ppermute steps hidden behind
partial matmuls, written with `jax.shard_map` (`mesh.tp_overlap=collective_matmul`).

Legend as `msjax.model`: B batch, T sequence, D model width, H/G query/key-value heads, K head dim, F MLP width;
`tp` the size of mesh axis `tensor`, `sp` of `sequence`; a trailing `l` (Hl, Gl, Fl) means this device's 1/tp
share; Tc = T / (sp * tp) is one device's slice of the residual stream, Ts = T / sp one sequence shard.

Megatron sequence parallelism (Korthikanti et al. 2022) keeps the residual stream split over `tensor` along T.
Each tensor-parallel region starts with an all-gather of the normed input along T followed by the column-parallel
matmul, and ends with the row-parallel matmul followed by a reduce-scatter along T. Under GSPMD both collectives
are whole (the matmul waits for the gather; the scatter waits for the matmul). Here they are decomposed
(Wang et al., ASPLOS'23, "Overlap communication with dependent computation via decomposition"; JAX's shard_map
notes, "collective matmul"):

  all-gather -> matmul (`ag_matmul`): each device's slice of x travels around the `tensor` ring by `ppermute`;
    at step i the device multiplies the slice it holds (from device d - dir * i) while the next one is in
    flight. Bidirectional: the slice is cut in two halves that travel opposite ways, so both directions of every
    link carry half the bytes and each of the tp - 1 steps moves Tc / 2 rows.
  matmul -> reduce-scatter (`matmul_rs`): an accumulator per half travels the ring; at each step the device adds
    its partial product for the accumulator's destination slice while the accumulator moves on. After tp - 1
    steps each device holds the full sum of its own slice.

JAX differentiates this code itself: the transpose of `ppermute` is the reverse `ppermute` and of a dynamic
slice a dynamic update, so the backward is decomposed too (the forward's ag_matmul becomes a matmul ->
reduce-scatter ring for dx and local matmuls for dW; matmul_rs becomes an all-gather ring).

`block` runs one transformer layer this way. With `model.block=parallel` attention and MLP read the same normed
input and their outputs are summed (MegaScale Fig. 3), so their column-parallel weights (wq, wk, wv, w_in, and
w_gate with SwiGLU) are concatenated into one matmul fed by ONE all-gather ring, and their two row-parallel weights
(wo, w_out) into one matmul drained by ONE reduce-scatter ring. Serial blocks take one of each per branch
(Megatron-SP). Biases, rotary embeddings (at each shard's own positions) and the MLP's activation are the model's
own code (`Attention.finish_qkv`, `MLP.activate`), so every block the model has runs here too.

The shard_map is manual over `data`, `fsdp`, `sequence` and `tensor` (`pipeline` stays automatic). FSDP-sharded
weights are all-gathered over `fsdp` by hand inside (the transpose reduce-scatters their gradients), and
gradients of weights replicated over `data` are summed by shard_map's own transpose. The batch axes are manual
on purpose: left automatic, GSPMD replicated the batch around attention inside the body (seen in the compiled
HLO; a nested shard_map for attention did not lower in jax 0.10). Under context parallelism keys and values are
all-gathered over `sequence` with `jax.lax.all_gather` (its transpose reduce-scatters dK/dV) and queries are
masked at their offset.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from msjax.ops.attention import local_attention
from msjax.sharding import active_rules, nested_shard_map
from msjax.sharding_rules import axes as ax
from msjax.sharding_rules import logical_to_mesh_spec

MANUAL_AXES = (ax.DATA, ax.FSDP, ax.SEQUENCE, ax.TENSOR)


def _ring(n: int, direction: int) -> list[tuple[int, int]]:
    """ppermute pairs sending device d's buffer to d + direction (mod n)."""
    return [(d, (d + direction) % n) for d in range(n)]


def _parts(x: jax.Array, axis: int) -> list[tuple[jax.Array, int]]:
    """This device's rows (along `axis`) cut into (part, ring direction): two halves travelling opposite ways
    (bidirectional), or the whole slice one way when its length is odd."""
    tc = x.shape[axis]
    if tc % 2:
        return [(x, -1)]
    lo, hi = jnp.split(x, 2, axis=axis)
    return [(lo, -1), (hi, +1)]


def ag_matmul(x_bcd: jax.Array, w_dn: jax.Array, axis: str = ax.TENSOR) -> jax.Array:
    """all_gather(x, axis, along T) @ w, decomposed into ppermute steps overlapped with partial matmuls.

    Call inside `jax.shard_map` with `axis` manual.

    Args:
      x_bcd: this device's slice of the sequence (B, Tc, D); device i holds rows [i Tc, (i + 1) Tc).
      w_dn: this device's column block of the weight (D, N).
      axis: the mesh axis to gather over.
    Returns:
      (B, tp * Tc, N) in the dtype of x @ w: the product for every device's rows, in device order.
    """
    n = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    if n == 1:
        return x_bcd @ w_dn
    parts = _parts(x_bcd, axis=1)
    held = [part for part, _ in parts]
    products = [[] for _ in parts]  # products[j][i]: part j's rows from device me - direction * i
    for i in range(n):
        # Both directions' sends first, then the matmuls on what is here: transfers and matmuls are independent,
        # so the scheduler can run them at the same time.
        sent = [jax.lax.ppermute(p, axis, _ring(n, d)) for p, (_, d) in zip(held, parts)] if i < n - 1 else held
        for j, p in enumerate(held):
            products[j].append(p @ w_dn)
        held = sent
    outs = []
    for (_, direction), prods in zip(parts, products):
        # Put device s's rows at s: step i held device me - direction * i, so order the steps by source
        # (direction -1: steps 0, 1, .., n-1 are sources me, me+1, ..; direction +1: me, me-1, ..) and rotate by me.
        # A rotation (not a scatter into a zeros buffer) keeps GSPMD's batch sharding of the products.
        by_offset = prods if direction == -1 else [prods[0]] + prods[:0:-1]
        outs.append(jnp.roll(jnp.stack(by_offset, axis=1), me, axis=1))
    # (B, n, parts, Tc / parts, N) -> (B, n * Tc, N): device s's rows are its parts in order.
    out = jnp.stack(outs, axis=2)
    return out.reshape(out.shape[0], n * x_bcd.shape[1], w_dn.shape[1])


def matmul_rs(h_btf: jax.Array, w_fd: jax.Array, axis: str = ax.TENSOR) -> jax.Array:
    """reduce_scatter(h @ w, axis, along T), decomposed into ppermute steps overlapped with partial matmuls.

    Call inside `jax.shard_map` with `axis` manual; the sum over `axis` is the row-parallel reduction.

    Args:
      h_btf: this device's activations for every row (B, tp * Tc, F), F its share of the contraction.
      w_fd: this device's row block of the weight (F, D).
      axis: the mesh axis to reduce over.
    Returns:
      (B, Tc, D): rows [i Tc, (i + 1) Tc) of sum over devices of h @ w, on device i.
    """
    n = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    if n == 1:
        return h_btf @ w_fd
    b, t, f = h_btf.shape
    h_bntf = h_btf.reshape(b, n, t // n, f)  # (B, destination device, Tc, F)
    parts = _parts(h_bntf, axis=2)  # each (B, n, Tc / parts, F), the destination device on axis 1
    outs = [None] * len(parts)
    for i in range(n):
        # The accumulator held at step i is bound for device me + direction * (n - 1 - i); it then moves one hop
        # on, so the last step leaves each device its own rows. The partial product for this step does not wait
        # for the accumulator in flight.
        sent = [None if acc is None else jax.lax.ppermute(acc, axis, _ring(n, d))
                for acc, (_, d) in zip(outs, parts)]
        for j, (part, direction) in enumerate(parts):
            dest = (me + direction * (n - 1 - i)) % n
            partial = jax.lax.dynamic_index_in_dim(part, dest, axis=1, keepdims=False) @ w_fd
            outs[j] = partial if sent[j] is None else sent[j] + partial
    return jnp.concatenate(outs, axis=1)


def _manual_spec(names, rules) -> P:
    """The PartitionSpec of logical `names` under `rules`, keeping only the manual axes (all but pipeline)."""
    out = []
    for entry in logical_to_mesh_spec(tuple(names), rules):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(a for a in axes if a in MANUAL_AXES)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


def block(blk, x_btd: jax.Array) -> jax.Array:
    """One transformer layer (`msjax.model.Block`) with collective-matmul tensor parallelism.

    Args:
      blk: the Block (its parameters may be tracers: this runs inside the layer scan).
      x_btd: the residual stream (B, T, D), laid out (act_batch, act_seq, act_embed) by the active rules.
    Returns:
      (B, T, D), the layer's output, laid out like x.
    Raises:
      ValueError: called outside `msjax.sharding.use_rules`, with a rule set that does not split the
        residual stream over (sequence, tensor) (the Megatron-SP layout this code decomposes), or with weight
        matmuls in another dtype than the activations (`model.matmul_dtype`).
    """
    active = active_rules()
    if active is None:
        raise ValueError("collective_matmul.block needs the active mesh and rules (msjax.sharding.use_rules)")
    mesh, rules = active
    if blk.attn.matmul_dtype != blk.attn.dtype:
        # The rings below multiply in the activations' dtype; mixed operands would need their own backward here.
        raise ValueError(f"mesh.tp_overlap=collective_matmul multiplies in model.dtype ({blk.attn.dtype}); "
                         f"model.matmul_dtype resolved to {blk.attn.matmul_dtype} here: set "
                         f"model.matmul_dtype=activations")
    x_spec = _manual_spec((ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED), rules)
    if x_spec[1:] != ((ax.SEQUENCE, ax.TENSOR), None):
        raise ValueError(f"mesh.tp_overlap=collective_matmul needs a rule set that splits act_seq over "
                         f"(sequence, tensor) (Megatron-SP, e.g. fsdp_tp); this one gives {x_spec}")
    graphdef, state = nnx.split(blk)
    params = nnx.to_pure_dict(state)
    # Inside the layer scan the names still start with `layers`, which the scanned slice no longer has.
    specs = jax.tree.map(lambda s, p: _manual_spec(tuple(s)[len(s) - p.ndim:], rules),
                         nnx.to_pure_dict(nnx.get_partition_spec(state)), params,
                         is_leaf=lambda s: isinstance(s, P))

    def body(params, x_bcd):
        # FSDP by hand: all-gather each weight over `fsdp` where it is split (its transpose reduce-scatters the
        # gradient); weights replicated over `data` get their gradient summed over it by shard_map's transpose.
        params = jax.tree.map(_gather_fsdp, params, specs, is_leaf=lambda s: isinstance(s, P))
        local = nnx.merge(graphdef, params)
        return _parallel_block(local, x_bcd) if local.parallel else _serial_block(local, x_bcd)

    return nested_shard_map(body, mesh, in_specs=(specs, x_spec), out_specs=x_spec, axis_names=MANUAL_AXES,
                            check_vma=True)(params, x_btd)


def _gather_fsdp(w: jax.Array, spec: P) -> jax.Array:
    """This device's shard of a weight, all-gathered over `fsdp` on the dimension split over it."""
    for dim, entry in enumerate(spec):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if ax.FSDP in axes and jax.lax.axis_size(ax.FSDP) > 1:
            if axes != (ax.FSDP,):
                raise ValueError(f"a weight split over {axes} on one dimension; collective_matmul gathers fsdp alone")
            w = jax.lax.all_gather(w, ax.FSDP, axis=dim, tiled=True)
    return w


def _column_weights(attn, mlp, dt) -> tuple[jax.Array, list[int]]:
    """The column-parallel weights side by side, (D, N), and the widths of the pieces, in order
    [q (Hl K), k (Gl K), v (Gl K)] + the MLP's input-side matrices (`MLP.column_weights`: [gate, up] for SwiGLU,
    [in] for GeLU, Fl each) when `mlp` is given."""
    d = attn.wq.shape[0]
    ws = [attn.wq[...].reshape(d, -1), attn.wk[...].reshape(d, -1), attn.wv[...].reshape(d, -1)]
    if mlp is not None:
        ws += mlp.column_weights()
    return jnp.concatenate([w.astype(dt) for w in ws], axis=1), [w.shape[1] for w in ws]


def _attention_core(attn, qkv_btn: jax.Array, widths: list[int]) -> jax.Array:
    """Biases, rotary embeddings, context-parallel key/value gather and attention on this device's heads:
    (B, Ts, Hl K)."""
    b, ts = qkv_btn.shape[:2]
    hl, gl, k = attn.wq.shape[1], attn.wk.shape[1], attn.wq.shape[2]
    q, kk, v = jnp.split(qkv_btn[..., : sum(widths[:3])], [widths[0], widths[0] + widths[1]], axis=-1)
    offset = jax.lax.axis_index(ax.SEQUENCE) * ts if jax.lax.axis_size(ax.SEQUENCE) > 1 else 0
    # This shard's rows sit at positions offset .. offset + Ts - 1 of the sequence (RoPE rotates by them).
    positions = offset + jnp.arange(ts, dtype=jnp.int32)[None]
    q_bthk, k_btgk, v_btgk = attn.finish_qkv(q.reshape(b, ts, hl, k), kk.reshape(b, ts, gl, k),
                                             v.reshape(b, ts, gl, k), positions)
    if jax.lax.axis_size(ax.SEQUENCE) > 1:
        # Context parallelism: every key, this shard's queries. all_gather transposes to a reduce-scatter, so the
        # backward reduce-scatters dK/dV instead of all-reducing them.
        k_btgk = jax.lax.all_gather(k_btgk, ax.SEQUENCE, axis=1, tiled=True)
        v_btgk = jax.lax.all_gather(v_btgk, ax.SEQUENCE, axis=1, tiled=True)
    o_bthk = local_attention(q_bthk, k_btgk, v_btgk, window=attn.window, impl=attn.impl, q_offset=offset)
    return o_bthk.reshape(b, ts, hl * k)


def _mlp_hidden(mlp, h_btn: jax.Array) -> jax.Array:
    """The MLP's hidden state from the products of its input-side matrices, side by side in `h_btn`."""
    return mlp.activate(*jnp.split(h_btn, len(mlp.column_weights()), axis=-1))


def _out_bias(*modules) -> jax.Array | int:
    total = 0
    for m in modules:
        if m.use_bias:
            total = total + (m.bo if hasattr(m, "bo") else m.b_out)[...].astype(m.dtype)
    return total


def _parallel_block(blk, x_bcd: jax.Array) -> jax.Array:
    """x + attn(ln(x)) + mlp(ln(x)) with ONE all-gather ring in and ONE reduce-scatter ring out."""
    attn, mlp, dt = blk.attn, blk.mlp, blk.attn.dtype
    h_bcd = blk.ln1(x_bcd)
    w_dn, widths = _column_weights(attn, mlp, dt)
    y_btn = ag_matmul(h_bcd, w_dn)  # (B, Ts, Hl K + 2 Gl K + Fl [+ Fl with SwiGLU])
    o_btn = _attention_core(attn, y_btn, widths)
    g_btf = _mlp_hidden(mlp, y_btn[..., sum(widths[:3]):])
    # Row-parallel weights stacked on the contraction: [wo (Hl K, D); w_out (Fl, D)].
    w_out = jnp.concatenate([attn.wo[...].reshape(-1, attn.wo.shape[-1]), mlp.w_out[...]], axis=0).astype(dt)
    z_bcd = matmul_rs(jnp.concatenate([o_btn, g_btf], axis=-1), w_out)
    return x_bcd + z_bcd + _out_bias(attn, mlp)


def _serial_block(blk, x_bcd: jax.Array) -> jax.Array:
    """x + attn(ln1(x)), then + mlp(ln2(x)): one all-gather ring and one reduce-scatter ring per branch."""
    attn, mlp, dt = blk.attn, blk.mlp, blk.attn.dtype
    w_dn, widths = _column_weights(attn, None, dt)
    o_btn = _attention_core(attn, ag_matmul(blk.ln1(x_bcd), w_dn), widths)
    x_bcd = x_bcd + matmul_rs(o_btn, attn.wo[...].reshape(-1, attn.wo.shape[-1]).astype(dt)) + _out_bias(attn)
    w_in = jnp.concatenate([w.astype(dt) for w in mlp.column_weights()], axis=1)
    g_btf = _mlp_hidden(mlp, ag_matmul(blk.ln2(x_bcd), w_in))
    return x_bcd + matmul_rs(g_btf, mlp.w_out[...].astype(dt)) + _out_bias(mlp)
