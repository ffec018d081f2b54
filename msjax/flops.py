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
    """N: parameters in matmuls that a token multiplies by (weights of attention, the MLP (2 matrices for GeLU,
    3 for SwiGLU) and the vocabulary projection over the padded vocabulary). In a mixture-of-experts layer only
    the active ones: the router, the k experts a token goes to and the shared experts (Switch Transformer's and
    MaxText's convention: MFU of an MoE model counts active-parameter FLOPs)."""
    m = model_cfg
    d, h, kv, k, f = m.d_model, m.num_heads, m.kv_heads, m.head_size, m.ff_size
    v = m.padded_vocab(vocab_size)
    mlp_matrices = 3 if m.mlp == "swiglu" else 2
    attention = d * h * k + 2 * d * kv * k + h * k * d
    mo = m.moe
    expert_ff = mo.expert_ff or f
    moe_mlp = d * mo.num_experts + mlp_matrices * d * expert_ff * (mo.experts_per_token + mo.shared_experts) \
        + (d if mo.shared_gate else 0)
    moe_layers = sum(mo.is_moe_layer(i) for i in range(m.num_layers))
    return m.num_layers * attention + (m.num_layers - moe_layers) * mlp_matrices * d * f + moe_layers * moe_mlp \
        + v * d


def flops_per_token(model_cfg, seq_len: int, vocab_size: int | None = None,
                    megatron_convention: bool = False) -> float:
    """Training (forward + backward) model FLOPs per token; see the module docstring for the formula."""
    m = model_cfg
    k_bar = mean_attended_keys(seq_len, m.attention.window, megatron_convention)
    return 6.0 * matmul_params(m, vocab_size) + 12.0 * m.num_layers * m.num_heads * m.head_size * k_bar


# ---------------------------------------------------------------------------------------------------------------
# Executed matmul FLOPs of a traced program (the arithmetic a step really does, recompute and redundancy included).

# Primitives that call one sub-jaxpr with their own operands, and the parameter holding it.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr", "custom_lin": None}
# Concrete evaluation is for the control skeleton (tick counters, stage indices, predicates): small arrays only.
_CONCRETE_LIMIT = 1 << 16


def executed_matmul_flops(fn, *args, **kwargs) -> float:
    """FLOPs of every matrix product the traced program of `fn(*args, **kwargs)` executes: 2 per multiply-add of
    each `dot_general` (einsum, matmul, attention scores), summed over the whole program as it runs.

    What `compiled.cost_analysis()` cannot give (it counts a loop body once): the jaxpr is walked as an
    interpreter walks it, with the integer control skeleton evaluated concretely, so
      - a `scan` counts its body once per iteration (its length), a `while` loop as many times as its condition,
        evaluated on the loop's concrete counters, holds;
      - a `cond` counts the branch its concrete index selects (a data-dependent index is an error);
      - a `shard_map` counts its body once per member of its manual axes, with `axis_index` set to that member,
        so a pipeline's per-stage conditions are resolved stage by stage; inside it, shapes are global on the
        axes left to the compiler, so the total is the program's global arithmetic;
      - calls, `jax.checkpoint` (its recomputation appears in the backward) and custom derivatives are entered.
    Element-wise work, reductions, gathers and collectives are not counted: for a transformer the matmuls are
    the FLOPs (Kaplan et al. 2020, sec. 2.1).

    Args:
      fn, args, kwargs: as for `jax.make_jaxpr` (abstract `jax.ShapeDtypeStruct` arguments are fine).
    Returns:
      FLOPs (float).
    Raises:
      ValueError: a `cond` or `while` whose predicate depends on data, or a primitive whose arithmetic this
        count cannot see (`pallas_call`, convolutions).
    """
    import jax

    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    return _jaxpr_flops(closed.jaxpr, list(closed.consts), [None] * len(closed.jaxpr.invars), {})[0]


def _concrete(value):
    """`value` as a numpy array when it is a small concrete array, else None (unknown)."""
    import numpy as np

    if value is None:
        return None
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - tracers and other abstract values are unknown
        return None
    return array if array.size <= _CONCRETE_LIMIT else None


def _jaxpr_flops(jaxpr, consts: list, args: list, axis_env: dict) -> tuple[float, list]:
    """(FLOPs, output values) of one open jaxpr; values are small numpy arrays or None (unknown)."""
    import math

    import numpy as np

    env = {}

    def read(atom):
        if hasattr(atom, "val"):  # a Literal
            return _concrete(atom.val)
        return env.get(atom)

    for var, value in zip(jaxpr.constvars, consts):
        env[var] = _concrete(value)
    for var, value in zip(jaxpr.invars, args):
        env[var] = value
    total = 0.0
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name, params = eqn.primitive.name, eqn.params
        outs: list = [None] * len(eqn.outvars)
        if name == "dot_general":
            (lc, rc), (lb, rb) = params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            free = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
            total += 2.0 * math.prod(lhs) * math.prod(free)
        elif name == "ragged_dot_general":
            # a grouped matmul (`jax.lax.ragged_dot` and its transposes): each lhs row (or, ragged along the
            # contraction, each contracted element) meets one group's rhs, so 2 FLOPs per lhs element and free rhs
            # column, whatever the group sizes; not x groups, as a backend's dense fallback executes it
            dims = params["ragged_dot_dimension_numbers"]
            (_, rc), (_, rb) = dims.dot_dimension_numbers
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            skip = set(rc) | set(rb) | set(dims.rhs_group_dimensions)
            total += 2.0 * math.prod(lhs) * math.prod(d for i, d in enumerate(rhs) if i not in skip)
        elif name == "scan":
            total += _scan_flops(params, ins, axis_env, outs)
        elif name == "while":
            total += _while_flops(params, ins, axis_env, outs)
        elif name == "cond":
            index = ins[0]
            if index is None:
                raise ValueError("executed_matmul_flops: a cond whose branch index depends on data")
            branch = params["branches"][int(np.clip(index, 0, len(params["branches"]) - 1))]
            flops, outs = _jaxpr_flops(branch.jaxpr, list(branch.consts), ins[1:], axis_env)
            total += flops
        elif name == "shard_map":
            # the axes this shard_map makes manual (jax 0.10's name; older jax: manual_axes)
            mesh = params["mesh"]
            manual = sorted(params.get("newly_manual_axes", params.get("manual_axes", ())))
            sizes = [mesh.shape[a] for a in manual]
            # an input replicated over the manual axes (a schedule's table, say) is the same inside: known
            specs = params.get("in_specs", [None] * len(ins))
            inside = [x if spec is not None and all(e is None for e in spec) else None for x, spec in zip(ins, specs)]
            for member in np.ndindex(*sizes):
                flops, _ = _jaxpr_flops(params["jaxpr"], [], inside, {**axis_env, **dict(zip(manual, member))})
                total += flops
        elif name == "axis_index":
            outs = [np.asarray(axis_env[params["axis_name"]], np.int32)]
        elif name in _CALLS and _CALLS[name]:
            sub = params[_CALLS[name]]
            inner = getattr(sub, "jaxpr", sub)
            flops, outs = _jaxpr_flops(inner, list(getattr(sub, "consts", [])), ins[:len(inner.invars)], axis_env)
            total += flops
        elif name in ("pallas_call", "conv_general_dilated"):
            raise ValueError(f"executed_matmul_flops: cannot count the arithmetic of {name}")
        elif all(x is not None for x in ins) and all(math.prod(v.aval.shape) <= _CONCRETE_LIMIT
                                                     for v in eqn.outvars):
            try:
                result = eqn.primitive.bind(*ins, **params)
            except Exception:  # noqa: BLE001 - anything not evaluable eagerly stays unknown
                result = None
            if result is not None:
                outs = [_concrete(r) for r in (result if eqn.primitive.multiple_results else [result])]
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return total, [read(v) for v in jaxpr.outvars]


def _scan_flops(params: dict, ins: list, axis_env: dict, outs: list) -> float:
    body, length = params["jaxpr"], params["length"]
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    total = 0.0
    for i in (reversed(range(length)) if params["reverse"] else range(length)):
        x_i = [None if x is None else x[i] for x in xs]
        flops, result = _jaxpr_flops(body.jaxpr, list(body.consts), consts + carry + x_i, axis_env)
        total += flops
        carry = result[:n_carry]
    outs[:n_carry] = carry
    return total


def _while_flops(params: dict, ins: list, axis_env: dict, outs: list) -> float:
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, carry = ins[:n_cond], ins[n_cond:n_cond + n_body], ins[n_cond + n_body:]
    total = 0.0
    while True:
        _, (go,) = _jaxpr_flops(cond.jaxpr, list(cond.consts), cond_consts + carry, axis_env)
        if go is None:
            raise ValueError("executed_matmul_flops: a while loop whose trip count depends on data")
        if not bool(go):
            break
        flops, carry = _jaxpr_flops(body.jaxpr, list(body.consts), body_consts + carry, axis_env)
        total += flops
    outs[:] = carry
    return total
