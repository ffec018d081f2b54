"""Expert parallelism: a mixture of experts' tokens sent to the devices that hold their experts and back by
all-to-all under `jax.shard_map` (GShard, Lepikhin et al. 2020; Megatron-Core's all-to-all token dispatcher).

Legend as `msjax.ops.moe`: T tokens (a device's B x T rows, flattened), D model width, F expert MLP width, E
experts, k experts per token, N = T k assignments; `ep` the size of the mesh axis the `exp` logical axis lands on
(`expert`), El = E / ep the experts one device holds (device j holds experts j El .. (j + 1) El - 1), Fl the
expert width one `tensor` rank holds.

Where it runs. The model routes (float32 router, top-k, its losses over the whole batch: plain GSPMD code) and
hands the rest of the layer, its routed experts and its shared expert, to `experts`, the `Parallelism.experts`
point `use_expert_parallelism` installs. With a capacity, each device first finds which of its assignments their
experts keep, in the whole batch's token order as on one device (`_kept`), and zeroes the others' router weights.
Under `jax.shard_map` over the mesh each device takes its own batch rows (split over data x fsdp x expert, the
query-side sequence over `sequence`; gathered over `tensor`, as an MLP's input is), and its expert weights:
El experts, gathered over `fsdp` (the FSDP all-gather, done by GSPMD at the region's edge), their F split over
`tensor` (Megatron-style expert tensor parallelism: each rank computes its Fl columns, the outputs are summed over
`tensor`). Every rank of a `tensor` group routes the same tokens, so each group's all-to-alls are independent.
The shared expert (Qwen2-MoE, DeepSeek) runs in the same region on the same tokens, its width split over `tensor`
too, so its partial output joins the routed experts' in one sum over `tensor`; its matmuls run in the compute
dtype, as the routed experts' do (`model.matmul_dtype` and the weight-matmul point are the dense layers').

The dispatch (ep > 1), per device:
  1. sort the N assignments by expert (stable), so each destination device's are contiguous, and write them into a
     send buffer (ep, N, D): row j holds what goes to device j, zero-padded past its count;
  2. all-to-all over `expert`: row i of the receive buffer is what device i sent here (with the local expert id of
     each row; padding carries the id El, which sorts last);
  3. sort the received rows by local expert and run them through this device's El experts as grouped matmuls
     (`msjax.ops.moe.grouped_mlp`, padding rows come out as zeros);
  4. all-to-all back, and each token sums its k outputs weighted by the router, in float32.
Overlap: the shared expert's matmuls are issued between the dispatch all-to-all (step 2) and the grouped matmuls,
and neither depends on the other, so a scheduler with asynchronous collectives (XLA:GPU's latency-hiding
scheduler) runs them while the tokens are in flight (MegaScale-MoE's overlap of communication with the dense
part; tests/msjax/test_moe.py reads the order and the independence from the lowered program).
With ep = 1 (expert parallelism off, the batch still split) each device runs `msjax.ops.moe.expert_ffn` on its own
tokens: no device sorts or computes another's (GSPMD would have to gather the batch to sort it).

Dropless with fixed shapes. `jax.lax.all_to_all` moves equal-sized blocks, and every assignment of a device may
go to one peer, so each block is N rows: the buffers are (ep, N, D) on both sides, ep times the tokens'
assignments (the worst case MaxText sizes its receive buffer for). `jax.lax.ragged_all_to_all`, which sends only
the rows there are, is not implemented by XLA:CPU (jax 0.10: "HLO opcode ragged-all-to-all is not supported by
XLA:CPU ThunkEmitter"), where this runs and is tested. The grouped matmuls see ep N rows of which N on average
are real; `ragged_dot` skips the padding where its backend computes by group sizes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from msjax.ops import moe as moe_ops
from msjax.sharding import active_rules, nested_shard_map, use_parallelism
from msjax.sharding_rules import axes as ax
from msjax.sharding_rules import logical_to_mesh_spec


DISPATCH_SCOPE = "moe_dispatch"  # the named scope of the dispatch's own work: packing, all-to-alls, unpacking


@contextlib.contextmanager
def use_expert_parallelism() -> Iterator[None]:
    """Runs the dropless mixture-of-experts layers traced inside (under `msjax.sharding.use_rules`) with `experts`:
    each device its own tokens and, over the expert axis, its own experts."""
    with use_parallelism(experts=experts):
        yield


def _axis_of(rules: Any, name: str) -> str | None:
    """The one mesh axis logical axis `name` lands on under `rules`, or None (replicated)."""
    spec = logical_to_mesh_spec((name,), rules)[0]
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"logical axis {name!r} lands on mesh axes {spec}; expert parallelism takes one")
    return spec


def experts(moe: Any, x_btd: jax.Array, weights_btk: jax.Array, experts_btk: jax.Array, keep: int | None = None
            ) -> tuple[jax.Array, jax.Array]:
    """The layer's output (B, T, D) in x's dtype, routed experts plus shared expert, computed as the module
    docstring says, and the float32 fraction of the B T k assignments dropped (0 when dropless).

    Args:
      moe: the layer (`msjax.model.MoE`): `column_weights()` (E, D, F) each, `activate`, `w_out` (E, F, D), `dtype`,
        and `shared` (None, or an MLP: its `column_weights()` (D, Fs), `activate`, `w_out` (Fs, D)) with
        `shared_gate` (None or (D, 1)).
      x_btd: (B, T, D) the layer's input in the compute dtype.
      weights_btk: (B, T, k) float32 router weights; experts_btk: (B, T, k) int32 expert ids in [0, E).
      keep: assignments each expert keeps over the whole batch (`msjax.ops.moe.capacity`), in the batch's token
        order as on one device (`_kept`); None: dropless.
    Raises:
      ValueError: outside `msjax.sharding.use_rules`, or a rule set that puts `exp` or `mlp` on several axes.
    """
    active = active_rules()
    if active is None:
        raise ValueError("expert parallelism needs the active mesh and rules (msjax.sharding.use_rules)")
    mesh, rules = active
    expert_axis, tensor_axis = _axis_of(rules, ax.EXP), _axis_of(rules, ax.MLP)
    ep = mesh.shape[expert_axis] if expert_axis else 1
    tokens = logical_to_mesh_spec((ax.ACT_BATCH, ax.ACT_SEQ_INNER, None), rules)
    if ep > 1 and expert_axis not in tuple(tokens[0] or ()):
        raise ValueError(f"expert parallelism over {expert_axis!r} needs the batch split over it too "
                         f"(act_batch lands on {tokens[0]})")
    dt = moe.dtype
    routed = {"cols": moe.column_weights(), "w_out": moe.w_out[...].astype(dt)}
    routed_specs = {"cols": [P(expert_axis, None, tensor_axis)] * len(routed["cols"]),
                    "w_out": P(expert_axis, tensor_axis, None)}
    shared, shared_specs = {}, {}
    if moe.shared is not None:
        shared = {"cols": [c.astype(dt) for c in moe.shared.column_weights()],
                  "w_out": moe.shared.w_out[...].astype(dt)}
        shared_specs = {"cols": [P(None, tensor_axis)] * len(shared["cols"]), "w_out": P(tensor_axis, None)}
        if moe.shared_gate is not None:
            shared["gate"], shared_specs["gate"] = moe.shared_gate[...].astype(jnp.float32), P()

    def shared_expert(x_td, weights):
        """The shared expert's partial output (T, D) over this rank's Fs columns, gated per token when set."""
        h_tf = moe.shared.activate(*(jnp.dot(x_td, w) for w in weights["cols"]))
        y_td = jnp.dot(h_tf.astype(dt), weights["w_out"])
        if "gate" in weights:
            gate_t1 = jax.nn.sigmoid(jnp.dot(x_td.astype(jnp.float32), weights["gate"]))
            y_td = (y_td.astype(jnp.float32) * gate_t1).astype(dt)
        return y_td

    batch_axes = (tokens[0],) if isinstance(tokens[0], str) else tuple(tokens[0] or ())
    seq_axis = tokens[1]
    experts_count = moe.w_out.shape[0]

    def per_device(x_btd, weights_btk, experts_btk, routed, shared):
        b, t, d = x_btd.shape
        k = experts_btk.shape[-1]
        dropped = jnp.float32(0.0)
        if keep is not None:  # a dropped assignment's output is weighted by 0: the token keeps its residual alone
            kept_btk, dropped = _kept(experts_btk, experts_count, keep, batch_axes, seq_axis)
            weights_btk = jnp.where(kept_btk, weights_btk, 0.0)
        x_td, w_tk, e_tk = x_btd.reshape(b * t, d), weights_btk.reshape(b * t, k), experts_btk.reshape(b * t, k)
        meanwhile = (lambda: shared_expert(x_td, shared)) if shared else None
        if ep == 1:
            y_td, _ = moe_ops.expert_ffn(x_td, w_tk, e_tk, routed["cols"], routed["w_out"], moe.activate)
            extra_td = meanwhile() if meanwhile else None
        else:
            y_td, extra_td = _dispatch(x_td, w_tk, e_tk, routed["cols"], routed["w_out"], moe.activate, ep,
                                       expert_axis, meanwhile)
        if extra_td is not None:
            y_td = y_td + extra_td
        if tensor_axis is not None:  # each rank's Fl (and Fs) columns give a partial sum of the outputs
            y_td = jax.lax.psum(y_td, tensor_axis)
        return y_td.reshape(b, t, d), dropped

    route_spec = P(*tokens[:2], None)
    return nested_shard_map(per_device, mesh, in_specs=(tokens, route_spec, route_spec, routed_specs, shared_specs),
                            out_specs=(tokens, P()))(x_btd, weights_btk, experts_btk, routed, shared)


def _kept(experts_btk: jax.Array, e: int, keep: int, batch_axes: tuple[str, ...], seq_axis: str | None
          ) -> tuple[jax.Array, jax.Array]:
    """Which of this device's assignments its expert keeps under a capacity, exactly as on one device: an
    assignment is kept when fewer than `keep` assignments to its expert come before it in the whole batch's token
    order (row by row, position by position, the k choices in order), counted across the devices that split the
    batch (`batch_axes`, rows in blocks, the first axis major) and the sequence (`seq_axis`): the counts of the
    rows before, of the same row on earlier sequence shards, and of the earlier positions here. Two small
    all-gathers of per-expert counts; no token moves.

    Args:
      experts_btk: (b, t, k) int32 expert ids of this device's tokens.
      e: experts; keep: assignments each expert keeps.
    Returns:
      ((b, t, k) bool kept, float32 fraction of the whole batch's assignments dropped).
    """
    b, t, k = experts_btk.shape
    onehot_bne = jax.nn.one_hot(experts_btk.reshape(b, t * k), e, dtype=jnp.int32)
    here_be = jnp.sum(onehot_bne, axis=1)
    earlier_here_bne = jnp.cumsum(onehot_bne, axis=1) - onehot_bne  # same expert, earlier in this shard's row
    row_be, before_bne = here_be, earlier_here_bne
    if seq_axis is not None:  # the row's earlier sequence shards come first
        shards_sbe = jax.lax.all_gather(here_be, seq_axis)
        me = jax.lax.axis_index(seq_axis)
        before_bne = before_bne + jnp.sum(jnp.where(jnp.arange(shards_sbe.shape[0])[:, None, None] < me,
                                                    shards_sbe, 0), axis=0)[:, None, :]
        row_be = jnp.sum(shards_sbe, axis=0)
    before_bne = before_bne + (jnp.cumsum(row_be, axis=0) - row_be)[:, None, :]  # earlier rows of this block
    if batch_axes:  # earlier row blocks
        blocks_ie = jax.lax.all_gather(jnp.sum(row_be, axis=0), batch_axes)
        me = jax.lax.axis_index(batch_axes)
        before_bne = before_bne + jnp.sum(jnp.where(jnp.arange(blocks_ie.shape[0])[:, None] < me, blocks_ie, 0),
                                          axis=0)
    rank_bn = jnp.sum(before_bne * onehot_bne, axis=-1)
    kept_bn = rank_bn < keep
    dropped = jnp.sum(1 - kept_bn.astype(jnp.int32))
    total = b * t * k
    for axis in (*batch_axes, *(() if seq_axis is None else (seq_axis,))):
        dropped, total = jax.lax.psum(dropped, axis), total * jax.lax.psum(1, axis)
    return kept_bn.reshape(b, t, k), dropped.astype(jnp.float32) / total


def _dispatch(x_td: jax.Array, weights_tk: jax.Array, experts_tk: jax.Array, cols_edf: list[jax.Array],
              w_out_efd: jax.Array, activate: Any, ep: int, axis: str, meanwhile: Callable[[], jax.Array] | None
              ) -> tuple[jax.Array, jax.Array | None]:
    """Steps 1-4 of the module docstring on one device: ((T, D) outputs, float32 sums cast to x's dtype; what
    `meanwhile()` returned, computed between the dispatch all-to-all and the grouped matmuls, or None).

    cols_edf / w_out_efd: this device's El experts ((El, D, Fl) / (El, Fl, D)); expert ids in experts_tk are
    global, in [0, ep El)."""
    t, k = experts_tk.shape
    n, d, local = t * k, x_td.shape[-1], w_out_efd.shape[0]
    with jax.named_scope(DISPATCH_SCOPE):
        flat_n = experts_tk.reshape(-1)
        order_n = jnp.argsort(flat_n, stable=True)  # by expert, hence by destination device
        expert_n = flat_n[order_n]
        dest_n = expert_n // local
        sent_j = jnp.bincount(dest_n, length=ep).astype(jnp.int32)
        slot_n = jnp.arange(n) - (jnp.cumsum(sent_j) - sent_j)[dest_n]  # the row within its destination's block
        token_n = order_n // k
        send_jnd = jnp.zeros((ep, n, d), x_td.dtype).at[dest_n, slot_n].set(x_td[token_n])
        send_jn = jnp.full((ep, n), local, jnp.int32).at[dest_n, slot_n].set(expert_n % local)
        recv_ind = jax.lax.all_to_all(send_jnd, axis, 0, 0)  # recv[i]: what device i sent here
        recv_in = jax.lax.all_to_all(send_jn, axis, 0, 0)
    extra_td = meanwhile() if meanwhile is not None else None  # reads none of the rows in flight
    with jax.named_scope(DISPATCH_SCOPE):
        local_r = recv_in.reshape(-1)
        order_r = jnp.argsort(local_r, stable=True)  # by local expert; padding (id El) last
        sizes_e = jnp.bincount(local_r, length=local + 1)[:local].astype(jnp.int32)
        rows_rd = recv_ind.reshape(ep * n, d)[order_r]
    y_rd = moe_ops.grouped_mlp(rows_rd, sizes_e, cols_edf, w_out_efd, activate)
    with jax.named_scope(DISPATCH_SCOPE):
        y_ind = jnp.zeros_like(y_rd).at[order_r].set(y_rd).reshape(ep, n, d)
        back_jnd = jax.lax.all_to_all(y_ind, axis, 0, 0)  # back[j]: device j's outputs for what this device sent it
        y_nd = back_jnd[dest_n, slot_n].astype(jnp.float32) * weights_tk.reshape(-1)[order_n][:, None]
        return jnp.zeros((t, d), jnp.float32).at[token_n].add(y_nd).astype(x_td.dtype), extra_td
