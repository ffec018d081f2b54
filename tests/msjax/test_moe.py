"""msjax.ops.moe against NumPy references (float64) on random data with uneven routing: the router, the dropless
grouped-matmul experts and their gradients, capacity dropping, the load-balancing and z losses."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.ops import moe

T, D, F, E = 48, 16, 24, 8


def _skewed_logits(key, t=T, e=E):
    """Random router logits with a per-expert bias, so some experts get many more tokens than others (and some
    may get none)."""
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, (t, e)) + 2.0 * jax.random.normal(k2, (e,))


def _np_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    return p / p.sum(axis=-1, keepdims=True)


def _np_route(logits, k, router, normalize):
    logits = np.asarray(logits, np.float64)
    probs = _np_softmax(logits)
    top = np.argsort(-(probs if router == "softmax_topk" else logits), axis=-1, kind="stable")[:, :k]
    if router == "softmax_topk":
        w = np.take_along_axis(probs, top, axis=-1)
        if normalize:
            w = w / w.sum(axis=-1, keepdims=True)
    else:
        w = _np_softmax(np.take_along_axis(logits, top, axis=-1))
    return w, top, probs


@pytest.mark.parametrize("router, normalize, k", [("softmax_topk", True, 2), ("softmax_topk", False, 2),
                                                  ("topk_softmax", True, 2), ("softmax_topk", True, 1),
                                                  ("topk_softmax", True, E)])
def test_route_matches_numpy(router, normalize, k):
    logits = _skewed_logits(jax.random.key(0))
    w, ex, probs = moe.route(logits.astype(jnp.bfloat16) if k == 1 else logits, k, router, normalize)
    ref_logits = logits.astype(jnp.bfloat16).astype(jnp.float32) if k == 1 else logits
    rw, rex, rprobs = _np_route(ref_logits, k, router, normalize)
    assert w.dtype == probs.dtype == jnp.float32 and ex.dtype == jnp.int32  # float32 router, whatever came in
    np.testing.assert_array_equal(np.asarray(ex), rex)
    np.testing.assert_allclose(np.asarray(w), rw, atol=1e-6)
    np.testing.assert_allclose(np.asarray(probs), rprobs, atol=1e-6)


def test_topk_softmax_is_normalised_softmax_topk():
    logits = _skewed_logits(jax.random.key(1))
    a, ea, _ = moe.route(logits, 2, "softmax_topk", True)
    b, eb, _ = moe.route(logits, 2, "topk_softmax")
    np.testing.assert_array_equal(np.asarray(ea), np.asarray(eb))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_router_losses_match_numpy():
    logits = _skewed_logits(jax.random.key(2))
    _, ex, probs = moe.route(logits, 2)
    p, top = np.asarray(probs, np.float64), np.asarray(ex)
    chosen = np.zeros((T, E))
    for t in range(T):
        chosen[t, top[t]] = 1.0
    ref = E * np.sum(chosen.mean(axis=0) * p.mean(axis=0))
    assert float(moe.load_balancing_loss(probs, ex)) == pytest.approx(ref, rel=1e-6)
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(axis=-1))
    assert float(moe.router_z_loss(logits)) == pytest.approx(np.mean(lse ** 2), rel=1e-6)
    # uniform routing: every expert chosen by the same number of tokens, equal probabilities -> the loss is k
    k = 3
    uniform = jnp.asarray([[(t + j) % E for j in range(k)] for t in range(E)], jnp.int32)
    assert float(moe.load_balancing_loss(jnp.full((E, E), 1.0 / E), uniform)) == pytest.approx(k, rel=1e-6)
    # skewed routing costs more than uniform
    assert float(moe.load_balancing_loss(probs, ex)) > 2.0


def _weights(key, swiglu):
    ks = jax.random.split(key, 4)
    cols = [jax.random.normal(ks[i], (E, D, F)) / math.sqrt(D) for i in range(2 if swiglu else 1)]
    return cols, jax.random.normal(ks[3], (E, F, D)) / math.sqrt(F)


def _activate(swiglu):
    return (lambda g, u: jax.nn.silu(g) * u) if swiglu else (lambda h: jax.nn.gelu(h))


def _np_act(swiglu, hs):
    def gelu(h):
        return 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    return hs[0] / (1 + np.exp(-hs[0])) * hs[1] if swiglu else gelu(hs[0])


def _np_experts(x, w, ex, cols, w_out, swiglu, keep=None):
    """Token by token, expert by expert; with `keep`, each expert serves its first `keep` assignments in token
    order (then the token's lower-ranked choices of the same step come after earlier tokens' choices)."""
    x, w, ex = np.asarray(x, np.float64), np.asarray(w, np.float64), np.asarray(ex)
    cols = [np.asarray(c, np.float64) for c in cols]
    w_out = np.asarray(w_out, np.float64)
    served = np.zeros(w_out.shape[0], int)
    y = np.zeros((x.shape[0], w_out.shape[-1]))
    dropped = 0
    for t in range(x.shape[0]):
        for j in range(ex.shape[1]):
            e = ex[t, j]
            served[e] += 1
            if keep is not None and served[e] > keep:
                dropped += 1
                continue
            h = _np_act(swiglu, [x[t] @ c[e] for c in cols])
            y[t] += w[t, j] * (h @ w_out[e])
    return y, dropped / ex.size


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_dropless_experts_match_numpy_and_their_gradients_match_a_dense_reference(swiglu):
    key = jax.random.key(3)
    x = jax.random.normal(key, (T, D))
    logits = _skewed_logits(jax.random.key(4))
    w, ex, _ = moe.route(logits, 2)
    sizes = np.bincount(np.asarray(ex).ravel(), minlength=E)
    assert sizes.max() >= 3 * sizes.mean() or (sizes == 0).any(), sizes  # the routing is uneven
    cols, w_out = _weights(jax.random.key(5), swiglu)
    y, dropped = moe.expert_ffn(x, w, ex, cols, w_out, _activate(swiglu))
    ref, _ = _np_experts(x, w, ex, cols, w_out, swiglu)
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5, rtol=1e-5)
    assert float(dropped) == 0.0

    def dense(x, w, cols, w_out):  # every expert on every token, combined by the router's weights
        hs = [jnp.einsum("td,edf->tef", x, c) for c in cols]
        y_ted = jnp.einsum("tef,efd->ted", _activate(swiglu)(*hs), w_out)
        combine = jnp.zeros((T, E)).at[jnp.arange(T)[:, None], ex].add(w)
        return jnp.einsum("te,ted->td", combine, y_ted)

    probe = jax.random.normal(jax.random.key(6), (T, D))

    def loss(f):
        return lambda x, w, cols, w_out: jnp.sum(probe * f(x, w, cols, w_out))

    got = jax.grad(loss(lambda *a: moe.expert_ffn(a[0], a[1], ex, a[2], a[3], _activate(swiglu))[0]),
                   argnums=(0, 1, 2, 3))(x, w, cols, w_out)
    want = jax.grad(loss(dense), argnums=(0, 1, 2, 3))(x, w, cols, w_out)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_an_experts_assignments_past_its_capacity(factor):
    x = jax.random.normal(jax.random.key(7), (T, D))
    w, ex, _ = moe.route(_skewed_logits(jax.random.key(8)), 2)
    cols, w_out = _weights(jax.random.key(9), False)
    keep = moe.capacity(T, 2, E, factor)
    assert keep == math.ceil(factor * T * 2 / E)
    y, dropped = moe.expert_ffn(x, w, ex, cols, w_out, _activate(False), keep)
    ref, ref_dropped = _np_experts(x, w, ex, cols, w_out, False, keep)
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5, rtol=1e-5)
    assert float(dropped) == pytest.approx(ref_dropped, abs=1e-7) and ref_dropped > 0


def test_bad_router_settings_name_what_is_allowed():
    logits = _skewed_logits(jax.random.key(10))
    with pytest.raises(ValueError, match=r"k=9: allowed is 1 <= k <= 8"):
        moe.route(logits, 9)
    with pytest.raises(ValueError, match=r"router 'sigmoid': allowed are softmax_topk, topk_softmax"):
        moe.route(logits, 2, "sigmoid")
    with pytest.raises(ValueError, match=r"capacity factor -1.0: allowed is >= 0"):
        moe.capacity(T, 2, E, -1.0)
    assert moe.capacity(T, 2, E, 0.0) is None


# The mixture of experts in the model and the training step (msjax.model.MoE, msjax.train_step).

def _moe_config(**over):
    from msjax.config import Config, apply_overrides

    base = {"model.vocab_size": 64, "model.d_model": 32, "model.num_heads": 4, "model.num_kv_heads": 2,
            "model.num_layers": 2, "model.max_seq_len": 16, "model.position": "rope", "model.norm": "rmsnorm",
            "model.mlp": "swiglu", "model.use_bias": False, "model.tie_embeddings": False,
            "model.moe.num_experts": E, "model.moe.expert_ff": 24, "train.seq_len": 16, "train.global_batch": 4,
            "mesh.data": 1}
    return apply_overrides(Config(), {**base, **over}).validate()


@pytest.mark.parametrize("over", [{}, {"model.moe.shared_experts": 2, "model.moe.shared_gate": True},
                                  {"model.mlp": "gelu", "model.moe.router": "topk_softmax", "model.dtype": "bfloat16"}],
                         ids=["swiglu", "shared-gated", "gelu-bf16"])
def test_the_moe_layer_is_its_experts_weighted_by_a_float32_router(over):
    """`model.MoE` on random weights against NumPy: router logits in float32 from the layer input, each token
    through its k experts (the layer's own weights) weighted by the router, plus the shared experts scaled by
    sigmoid(x . gate); its router statistics are `ops.moe`'s on those logits."""
    from flax import nnx

    from msjax.model import MoE, _matmul_setting, collect_router_stats

    cfg = _moe_config(**over).model
    with nnx.use_eager_sharding(False):
        layer = MoE(cfg, nnx.Rngs(0), _matmul_setting(cfg))
    dt = jnp.dtype(cfg.dtype)
    x = jax.random.normal(jax.random.key(11), (2, 8, cfg.d_model)).astype(dt)
    with collect_router_stats() as found:
        y = layer(x)
    x64 = np.asarray(x.astype(jnp.float32), np.float64).reshape(16, -1)
    logits = x64 @ np.asarray(layer.router[...], np.float64)
    w, ex, probs = _np_route(logits, cfg.moe.experts_per_token, cfg.moe.router, cfg.moe.normalize_topk)
    swiglu = cfg.mlp == "swiglu"
    cols = [layer.w_gate[...], layer.w_in[...]] if swiglu else [layer.w_in[...]]
    ref, _ = _np_experts(x64, w, ex, cols, layer.w_out[...], swiglu)
    if layer.shared is not None:
        s = layer.shared
        h = _np_act(True, [x64 @ np.asarray(s.w_gate[...], np.float64), x64 @ np.asarray(s.w_in[...], np.float64)])
        gate = 1 / (1 + np.exp(-(x64 @ np.asarray(layer.shared_gate[...], np.float64))))
        ref = ref + gate * (h @ np.asarray(s.w_out[...], np.float64))
    tol = 2e-2 if dt == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)).reshape(16, -1), ref, atol=tol, rtol=tol)
    (stats,) = found
    np.testing.assert_allclose(float(stats["z_loss"]), np.mean(np.log(np.exp(logits).sum(-1)) ** 2), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(stats["load"]), np.bincount(ex.ravel(), minlength=E) / ex.size)


@pytest.mark.parametrize("over", [{}, {"model.scan_layers": False, "model.num_layers": 4, "model.moe.every": 2},
                                  {"train.microbatches": 2, "model.remat": "full"},
                                  {"model.block": "parallel", "model.position": "learned", "model.norm": "layernorm",
                                   "model.mlp": "gelu", "model.use_bias": True, "model.tie_embeddings": True,
                                   "model.num_kv_heads": 4, "model.attention.window": 6, "model.remat": "dots"}],
                         ids=["scanned", "every-2nd-layer", "accumulated-remat", "gpt-parallel-window-dots"])
def test_the_step_adds_the_router_losses_to_the_objective_and_reports_them(over):
    """The step optimises cross-entropy + aux_loss_coef x load-balancing + z_loss_coef x z (each averaged over
    the MoE layers) and reports the cross-entropy as "loss" (what evaluation computes on the same parameters)
    beside the router losses, dropped fraction and the most loaded expert's share. The gradient of the objective
    is checked against jax.grad of that sum written out (with gradient accumulation, of its mean over the
    microbatches, each with its own router statistics)."""
    from msjax.mesh import make_mesh
    from msjax.model import apply_with_stats
    from msjax.train_step import build_train_program, cross_entropy

    cfg = _moe_config(**{"model.moe.aux_loss_coef": 0.5, "model.moe.z_loss_coef": 0.1, **over})
    prog = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    state = prog.init_fn(jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (4, 17), 0, 64)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    params = jax.tree.map(lambda a: a.copy(), state["params"])
    val = float(prog.eval_fn(params, batch))
    new_state, metrics = prog.step_fn(state, batch)
    assert float(metrics["loss"]) == pytest.approx(val, rel=1e-5)
    assert {"moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_max_load"} <= set(metrics)
    assert float(metrics["moe_aux_loss"]) > 1.0 and float(metrics["moe_dropped"]) == 0.0  # k = 2: 2 if even
    assert float(metrics["moe_max_load"]) >= 1.0

    def objective(p, rows=slice(None)):
        logits, stats = apply_with_stats(prog.graphdef, p, batch["inputs"][rows])
        ce = cross_entropy(logits, batch["targets"][rows])
        return ce + 0.5 * jnp.mean(stats["aux_loss"]) + 0.1 * jnp.mean(stats["z_loss"]), stats

    def step_objective(p):  # the router statistics are per microbatch: rows m, m + M, .. (the step's split)
        m = cfg.train.microbatches
        parts = [objective(p, slice(i, None, m)) for i in range(m)]
        return sum(o for o, _ in parts) / m, jax.tree.map(lambda *a: sum(a) / m, *[s for _, s in parts])

    (want, stats), grads = jax.value_and_grad(step_objective, has_aux=True)(params)
    assert float(metrics["moe_z_loss"]) == pytest.approx(float(jnp.mean(stats["z_loss"])), rel=1e-5)
    assert float(want) > val + 0.5  # the router losses are in the objective
    _, step_grads = prog.grad_fn(params, batch)
    for g, r in zip(jax.tree.leaves(step_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-6, rtol=1e-4)


def test_moe_flops_count_the_active_experts():
    """MFU's numerator counts a token's router, k experts and shared experts, not all E experts."""
    from msjax.flops import matmul_params

    cfg = _moe_config(**{"model.moe.shared_experts": 1}).model
    d, f, v = cfg.d_model, 24, cfg.padded_vocab()
    attention = 2 * d * 32 + 2 * d * 16  # Q and O of 4 heads x 8, K and V of 2 heads x 8
    assert matmul_params(cfg) == 2 * (attention + d * E + 3 * d * f * (2 + 1)) + v * d
    dense = _moe_config(**{"model.moe.num_experts": 0}).model
    assert matmul_params(dense) == 2 * (attention + 3 * d * dense.ff_size) + v * d


@pytest.mark.parametrize("preset, total, active", [("mixtral_8x7b", 46_702_792_704, 12_879_925_248),
                                                   ("qwen3_30b_a3b", 30_532_122_624, 3_353_032_704)])
def test_moe_presets_have_their_published_parameter_counts(preset, total, active):
    """The planner's inventory (from the model's own parameters) gives the released checkpoints' counts: Mixtral
    8x7B's 46.7B (12.9B active: 2 of 8 experts), Qwen3-30B-A3B's 30.5B (3.3B active: 8 of 128). By hand, per
    layer: attention + E experts x 3 SwiGLU matrices + the router + two norms (+ Qwen3's q/k norms), times the
    layers, plus the untied embedding and output projection and the final norm."""
    from msjax.config import load_preset
    from msjax.planner import memory as mem

    cfg = load_preset(preset)
    m = cfg.model
    d, kvw, qw, e, f = m.d_model, m.kv_heads * m.head_size, m.num_heads * m.head_size, m.moe.num_experts, \
        m.moe.expert_ff
    layer = 2 * d * qw + 2 * d * kvw + e * 3 * d * f + d * e + 2 * d + (2 * m.head_size if m.qk_norm else 0)
    assert total == m.num_layers * layer + 2 * m.vocab_size * d + d
    assert mem.total_params(cfg, m.padded_vocab()) == total
    inactive = m.num_layers * (e - m.moe.experts_per_token) * 3 * d * f
    assert mem.active_params(cfg, m.padded_vocab()) == active == total - inactive


MOE_LLAMA = {"model.moe.num_experts": 4, "model.moe.expert_ff": 48, "model.moe.shared_experts": 1,
             "model.moe.shared_gate": True}


@pytest.mark.parametrize("mesh", [{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
                                  {"mesh.data": 4, "mesh.sequence": 2, "model.scan_layers": False}],
                         ids=["dp2-fsdp2-tp2", "dp4-sp2-unscanned"])
def test_a_moe_model_trains_the_same_on_a_mesh_as_on_one_device(layout_tokens, mesh):
    """Experts replicated over the mesh (no expert axis yet), tokens routed over the whole batch: the data, FSDP,
    tensor and sequence layouts run the same function as one device (tests/msjax/layouts.py: 3 steps' losses,
    gradient norms and the gradients at initialisation within 1e-5), the routing uneven (random router)."""
    from tests.msjax.layouts import LLAMA, assert_same, run_layout, tiny_config

    cfg = tiny_config(**LLAMA, **MOE_LLAMA, **mesh)
    want = run_layout(tiny_config(**LLAMA, **MOE_LLAMA, **{k: v for k, v in mesh.items() if k.startswith("model.")}),
                      layout_tokens, 1)
    assert_same(want, run_layout(cfg, layout_tokens))


# Eight experts (two per device at expert=4), no shared expert: every output of the layer crosses the all-to-all.
# Weights drawn 10x wider than the default 0.02: router logits of std ~1.6, so routing is far from even. Adam's eps
# at 1e-3: the final parameters are compared too, and with eps 1e-8 Adam divides a gradient of ~1e-8 by its own
# square root, turning the float32 rounding of a sum taken in another order (1e-9, seen on expert weights) into a
# 1e-5 step; with 1e-3 such a gradient moves its parameter by ~1e-5 lr, while the gradients that train (1e-3 to
# 1e-1 here) still take Adam-sized steps.
MOE_EP = {**MOE_LLAMA, "model.moe.num_experts": 8, "model.moe.shared_experts": 0, "model.moe.shared_gate": False,
          "model.init_std": 0.2, "optimizer.eps": 1e-3}


SHARED = {"model.moe.shared_experts": 1, "model.moe.shared_gate": True}


@pytest.mark.parametrize("mesh", [{"mesh.expert": 2}, {"mesh.expert": 4}, {"mesh.expert": 2, "mesh.tensor": 2},
                                  {"mesh.expert": 2, "mesh.fsdp": 2}, {"mesh.expert": 2, "mesh.tensor": 2, **SHARED},
                                  {"mesh.expert": 2, "mesh.sequence": 2, "mesh.tensor": 2}],
                         ids=["ep2", "ep4", "ep2-tp2", "ep2-fsdp2", "ep2-tp2-shared", "ep2-sp2-tp2"])
def test_expert_parallel_layouts_train_the_same_as_one_device(layout_reference, layout_tokens, mesh):
    """Experts split over the `expert` axis, tokens sent to them and back by all-to-all (the rest of the 8 fake
    devices data-parallel): 3 steps' losses, gradient norms, the gradients at initialisation and the parameters
    after the 3 steps within 1e-5 of one device (tests/msjax/layouts.py); ep2-tp2-shared adds a gated shared
    expert, computed in the same region, and ep2-sp2-tp2 splits the sequence too (each device dispatches its own
    sequence shard's tokens). The random router routes unevenly: checked on the reference's first step,
    where in each layer the most loaded expert gets over twice the assignments of the least loaded one (a device
    holding the busiest experts receives the most rows)."""
    from tests.msjax.layouts import LLAMA, TOL, assert_same, run_layout, tiny_config

    model = {k: v for k, v in mesh.items() if k.startswith("model.")}
    want = layout_reference(**LLAMA, **{**MOE_EP, **model})
    got = run_layout(tiny_config(**LLAMA, **{**MOE_EP, **mesh}), layout_tokens)
    assert_same(want, got)
    for x, y in zip(jax.tree.leaves(jax.device_get(want.state["params"])),
                    jax.tree.leaves(jax.device_get(got.state["params"]))):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)
    spec = got.state["params"]["blocks"]["mlp"]["w_in"].sharding.spec
    assert spec[1] == "expert", spec  # (layers, experts, embed, mlp): the experts really are split
    load = np.asarray(want.first_metrics["expert_load"])  # (layers, E)
    assert (load.max(axis=-1) > 2 * load.min(axis=-1)).all(), load


@pytest.mark.parametrize("mesh", [{"mesh.expert": 2}, {"mesh.expert": 2, "mesh.sequence": 2, "mesh.tensor": 2},
                                  {"mesh.expert": 4, "mesh.fsdp": 2}], ids=["ep2", "ep2-sp2-tp2", "ep4-fsdp2"])
def test_a_capacity_drops_the_same_assignments_under_expert_parallelism_as_on_one_device(layout_reference,
                                                                                          layout_tokens, mesh):
    """A capacity factor of 1 (each expert keeps its first ceil(B T k / E) assignments in the batch's token order)
    with the tokens split over devices, expert, sequence and fsdp: each device ranks its assignments against the
    counts of the rows and sequence shards before its own, so the same assignments are dropped as on one device.
    3 steps' losses, gradient norms, initial gradients and final parameters within 1e-5 of one device, and the
    dropped fraction of the first step equal (and above 5%: the capacity binds on this unevenly routed model)."""
    from tests.msjax.layouts import LLAMA, TOL, assert_same, run_layout, tiny_config

    capacity = {**MOE_EP, "model.moe.capacity_factor": 1.0}
    want = layout_reference(**LLAMA, **capacity)
    got = run_layout(tiny_config(**LLAMA, **{**capacity, **mesh}), layout_tokens)
    assert_same(want, got)
    for x, y in zip(jax.tree.leaves(jax.device_get(want.state["params"])),
                    jax.tree.leaves(jax.device_get(got.state["params"]))):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)
    dropped = float(want.first_metrics["moe_dropped"])
    assert dropped > 0.05 and float(got.first_metrics["moe_dropped"]) == pytest.approx(dropped, abs=1e-7)


# Four MoE layers for 2 stages x 2 virtual stages; M = 2 microbatches a step. One device accumulates the gradients
# of the same two microbatches (rows 0, 2, .. and 1, 3, ..: the pipeline's split), so its router statistics and
# losses are per microbatch as the pipeline's are.
PIPELINED = {"model.num_layers": 4, "pipeline.microbatches": 2}
REPORTED = ("loss", "moe_aux_loss", "moe_z_loss", "moe_max_load", "expert_load")


@pytest.mark.parametrize("layout", [
    {"mesh.pipeline": 2, "pipeline.virtual_stages": 2, "mesh.expert": 2, "mesh.data": 2},
    {"mesh.pipeline": 2, "pipeline.virtual_stages": 2, "pipeline.schedule": "zb-v", "mesh.expert": 2,
     "mesh.tensor": 2, "model.scan_layers": False, **SHARED},
], ids=["pp2-vpp2-ep2-dp2", "zbv-pp2-ep2-tp2-unscanned-shared"])
def test_expert_parallel_pipelines_train_the_same_as_one_device(layout_reference, layout_tokens, layout):
    """Experts split over `expert` inside pipeline stages, interleaved 1F1B (V = 2) and ZB-V (the backward split
    into B and W; the router and expert weights are no tapped weight matmul, so their gradients come in B): losses,
    gradient norms, initial gradients and the parameters after 3 steps within 1e-5 of one device accumulating the
    same two microbatches; and the first step's report (cross-entropy, both router losses, max load, per-layer
    expert load in layer order) within 1e-5 of its: the router losses' gradients flow through the chunks' vjps
    (seeded like the loss) and their statistics come back from the stages that ran the layers. Routing is uneven:
    in every layer the busiest expert gets over 1.5x the assignments of the idlest, in some over 2x."""
    from tests.msjax.layouts import LLAMA, TOL, assert_same, run_layout, tiny_config

    model = {k: v for k, v in layout.items() if k.startswith("model.")}
    want = layout_reference(**LLAMA, **{**MOE_EP, **PIPELINED, **model, "pipeline.microbatches": 0,
                                        "train.microbatches": 2})
    got = run_layout(tiny_config(**LLAMA, **{**MOE_EP, **PIPELINED, **layout}), layout_tokens)
    assert_same(want, got)
    for x, y in zip(jax.tree.leaves(jax.device_get(want.state["params"])),
                    jax.tree.leaves(jax.device_get(got.state["params"]))):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)
    for key in REPORTED:
        np.testing.assert_allclose(got.first_metrics[key], want.first_metrics[key], atol=TOL, rtol=0, err_msg=key)
    load = np.asarray(want.first_metrics["expert_load"])  # (layers, E): uneven, and layers unlike each other
    ratio = load.max(axis=-1) / load.min(axis=-1)
    assert load.shape == (4, 8) and (ratio > 1.5).all() and ratio.max() > 2, load
    assert np.abs(np.diff(load, axis=0)).max() > 0.01


@pytest.mark.parametrize("scan", [False, True], ids=["per-layer", "scanned"])
def test_a_pipeline_stash_keeps_no_copy_of_the_expert_weights(scan):
    """bf16 compute over float32 parameters, experts split over `expert` inside the stages, no remat: no stashed
    residual has the shape of an expert weight (E, D, F) / (E, F, D) or of one device's shard of it. Inside the
    dispatch's shard_map the remat policy sees shards, and a weight's bf16 shard there was saved in every stash
    slot, a copy of the layer's experts per microbatch in flight (per-layer parameters; it fails so when the
    policy is not told the shard shapes)."""
    from msjax.mesh import make_mesh
    from msjax.train_step import build_train_program
    from tests.msjax.layouts import LLAMA, VOCAB, tiny_config

    cfg = tiny_config(**LLAMA, **{**MOE_EP, **PIPELINED, "mesh.pipeline": 2, "mesh.expert": 2, "model.remat": "none",
                                  "model.scan_layers": scan, "model.dtype": "bfloat16", "model.param_dtype": "float32"})
    program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:4]), vocab_size=VOCAB)
    e, d, f = 8, cfg.model.d_model, cfg.model.moe.expert_ff
    weights = {(n, d, f) for n in (e, e // 2)} | {(n, f, d) for n in (e, e // 2)}
    entry = program.pipeline.stash_entry(4)
    assert entry and not [a.shape for a in entry if a.shape in weights]


def test_a_moe_run_logs_its_expert_load_and_the_report_draws_it(tmp_path, small_corpus):
    """train.run of a small MoE model on dp2 x fsdp2 x tp2: the router metrics in metrics.jsonl and TensorBoard,
    one expert_load.jsonl row per logging step (MoE layers x experts, each row summing to 1), and the report's
    heatmap."""
    import json

    from msjax.observe.report import write_report
    from msjax.train import run
    from tests.msjax.test_loggers import tensorboard_scalars
    from tests.msjax.tiny_runs import tiny_run_config

    cfg = tiny_run_config(tmp_path, small_corpus, **{"model.moe.num_experts": 4, "model.moe.expert_ff": 32,
                                                     "checkpoint.every": 0})
    run(cfg)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [m["step"] for m in metrics if "loss" in m]
    assert logged and all({"moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_max_load"} <= set(m)
                          for m in metrics if "loss" in m)
    tb, last = tensorboard_scalars(tmp_path / "run" / "tb"), [m for m in metrics if "loss" in m][-1]
    for key in ("moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_max_load"):
        assert sorted(tb[key]) == logged, (key, tb.get(key))
        assert tb[key][last["step"]] == pytest.approx(last[key], rel=1e-6)  # float32 in the event file
    rows = [json.loads(x) for x in (tmp_path / "run" / "expert_load.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == logged
    for r in rows:
        load = np.asarray(r["load"])
        assert load.shape == (2, 4) and np.allclose(load.sum(-1), 1.0, atol=1e-6)
    write_report(tmp_path / "run")
    assert (tmp_path / "run" / "report" / "expert_load.png").stat().st_size > 1000


def _ssa_dependents(lines: list[str], roots: set[str]) -> set[str]:
    """SSA values of MLIR `lines` (in order) that (transitively) use any of `roots`."""
    out = set(roots)
    for line in lines:
        m = re.match(r"\s*(%[\w#]+)(?::\d+)? = (.*)", line)
        if m and set(re.findall(r"%[\w#]+", m.group(2))) & out:
            out.add(m.group(1))
    return out


def test_the_shared_expert_runs_while_the_tokens_are_in_flight():
    """expert 2 x tensor 2, one MoE layer with a gated shared expert (D 64, Fs 48, so 24 columns per tensor rank).
    In the program as lowered (the order a latency-hiding scheduler starts from) the layer's region issues the
    dispatch all-to-all, then the shared expert's four matmuls (gate and up (64, 24), down (24, 64), its gate
    (64, 1)), then the grouped matmuls, then the all-to-all back; the shared matmuls read nothing the all-to-all
    returns. In the compiled program, too, no shared-expert matmul depends on the dispatch (XLA:CPU's collectives
    are synchronous, so its own order shows nothing about overlap)."""
    from msjax.mesh import make_mesh
    from msjax.train_step import build_train_program
    from tests.msjax.hlo_utils import dependents, is_matmul, parse
    from tests.msjax.layouts import LLAMA, VOCAB, tiny_config

    cfg = tiny_config(**LLAMA, **{**MOE_EP, **SHARED, "model.num_layers": 1, "mesh.expert": 2, "mesh.tensor": 2,
                                  "mesh.data": -1})
    program = build_train_program(cfg, make_mesh(cfg.mesh), vocab_size=VOCAB)
    lowered = program.eval_fn.lower(program.abstract_state["params"], program.abstract_batch)
    lines = lowered.as_text().splitlines()
    start = next(n for n, line in enumerate(lines) if "sdy.manual_computation" in line and "expert" in line)
    region = lines[start:]
    shared_w = ("tensor<64x24xf32>) ->", "tensor<24x64xf32>) ->", "tensor<64x1xf32>) ->")
    ops = []
    for line in region:
        if "stablehlo.all_to_all" in line:
            ops.append(("A", line))
        elif "stablehlo.dot_general" in line:
            ops.append(("S" if any(w in line for w in shared_w) else "G", line))
    order = "".join(code for code, _ in ops)
    assert re.match(r"AASSSSG+A", order), order  # ids and tokens out, shared expert, experts, outputs back
    dispatched = {re.match(r"\s*(%[\w#]+)", line).group(1) for code, line in ops[:2]}
    uses = _ssa_dependents(region, dispatched)
    shared = [re.match(r"\s*(%[\w#]+)", line).group(1) for code, line in ops if code == "S"]
    experts = [re.match(r"\s*(%[\w#]+)", line).group(1) for code, line in ops if code == "G"]
    assert not uses & set(shared) and set(experts) <= uses

    comps = parse(lowered.compile().as_text())
    body = comps["ENTRY"]
    tokens = [i for i in body.instrs if i.op == "all-to-all" and "shard_map" in i.line and i.shapes[0][0] == "f32"
              and len(i.shapes[0][1]) == 3 and i.shapes[0][1][-1] == 64]
    assert len(tokens) == 2  # out to the experts, back from them
    after = dependents(body, {tokens[0].name})
    shared_mm = [i for i in body.instrs if is_matmul(i, comps) and i.shapes[0][1] in ((64, 24), (64, 1))]
    assert len(shared_mm) >= 3 and not {i.name for i in shared_mm} & after, [i.line[:120] for i in shared_mm]
    assert tokens[1].name in after


@pytest.mark.parametrize("mesh", [{"mesh.expert": 2, "mesh.tensor": 2, "mesh.fsdp": 2},
                                  {"mesh.expert": 4, "mesh.data": 2, "mesh.rules": "tp"}], ids=["ep2-tp2-fsdp2", "ep4"])
def test_the_planners_state_bytes_are_the_expert_parallel_steps_arguments(mesh):
    """The planner's analytic per-device state and batch bytes (`compile_check.analytic_bytes`: every expert's
    weights and Adam moments split over expert x fsdp x tensor as the rule set says) against XLA's argument bytes
    of the compiled step: within 1%, the check the planner's dense layouts pass (a first piece of pricing MoE)."""
    from msjax.mesh import make_mesh
    from msjax.planner.compile_check import analytic_bytes
    from msjax.train_step import build_train_program
    from tests.msjax.layouts import LLAMA, VOCAB, tiny_config

    cfg = tiny_config(**LLAMA, **{**MOE_EP, **SHARED, "model.vocab_size": VOCAB, "mesh.data": 1, **mesh})
    program = build_train_program(cfg, make_mesh(cfg.mesh), vocab_size=VOCAB)
    compiled = program.step_fn.lower(program.abstract_state, program.abstract_batch).compile()
    xla = compiled.memory_analysis().argument_size_in_bytes
    analytic = analytic_bytes(program.config, cfg.mesh.axis_sizes())
    assert abs(xla / analytic["total"] - 1) <= 0.01, (xla, analytic)


@pytest.mark.slow
def test_an_expert_parallel_run_resumes_bit_identically_and_onto_another_expert_size(tmp_path, small_corpus):
    """8 steps of a 4-expert model on data 2 x expert 2 x tensor 2 (checkpoint every 4) against 4 steps and then
    a resume of the rest: on the same mesh bit for bit (parameters, optimizer state, step, RNG); from a copy of the
    same step-4 checkpoint on expert 4 x tensor 2 (each device one expert instead of two, the checkpoint's experts
    re-split on restore) within 1e-5 (sums taken in another order; Adam's eps as in MOE_EP, for the same reason)."""
    import shutil

    from msjax.train import run
    from tests.msjax.tiny_runs import tiny_run_config

    moe = {"model.moe.num_experts": 4, "model.moe.expert_ff": 32, "mesh.fsdp": 1, "mesh.expert": 2,
           "optimizer.eps": 1e-3, "train.sample_tokens": 0}
    straight = run(tiny_run_config(tmp_path / "a", small_corpus, **moe))
    run(tiny_run_config(tmp_path / "b", small_corpus, **moe, **{"train.steps": 4}))
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    resumed = run(tiny_run_config(tmp_path / "b", small_corpus, **moe, **{"checkpoint.resume": True}))
    other = run(tiny_run_config(tmp_path / "c", small_corpus, **{**moe, "mesh.data": 1, "mesh.expert": 4,
                                                                 "checkpoint.resume": True}))
    assert resumed.start_step == other.start_step == 4
    want = jax.tree.leaves(jax.device_get(straight.state))
    for x, y in zip(want, jax.tree.leaves(jax.device_get(resumed.state))):
        np.testing.assert_array_equal(y, x)
    for x, y in zip(want, jax.tree.leaves(jax.device_get(other.state))):
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)
    assert other.state["params"]["blocks"]["mlp"]["w_in"].sharding.shard_shape((2, 4, 32, 32))[1] == 1


def test_a_resumed_run_keeps_the_expert_load_rows_of_the_steps_it_resumes_from(tmp_path):
    """Rows of steps after the checkpoint a run resumes from (written by an attempt that died before saving
    them) are dropped, the others kept, and the new rows appended after them."""
    import json

    from msjax.hooks import RunContext
    from msjax.observe.experts import EXPERT_LOAD_FILE, ExpertLoadLog

    path = tmp_path / EXPERT_LOAD_FILE
    path.write_text("".join(json.dumps({"step": s, "load": [[0.5, 0.5]]}) + "\n" for s in (2, 4, 6)))
    ctx = RunContext(config=None, run_dir=tmp_path, mesh=None, program=None, start_step=4, control=None)
    log = ExpertLoadLog()
    log.on_start(ctx)
    log.on_step_end(ctx, 6, {"expert_load": jnp.asarray([[0.25, 0.75]])})
    log.on_log(ctx, 6, {})
    log.on_end(ctx, None)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6] and rows[-1]["load"] == [[0.25, 0.75]]
