"""Packed sequences through the model and the loss: several examples in one row (segment ids, positions restarting
per example) compute what each example computes alone, on every attention path and layout that takes them.

The reference is the same examples unpacked, one per row and padded; compared are the per-token sums (the weighted
loss times the number of tokens trained on) and their gradients, float32, within TOL.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.config import ConfigError, apply_overrides, Config
from msjax.mesh import make_mesh
from msjax.model import Packing, apply, init_params
from msjax.train_step import batch_keys, build_train_program, cross_entropy

from tests.msjax.layouts import BASE, LLAMA, VOCAB

TOL = 1e-5
T = 32


def _config(**overrides) -> Config:
    return apply_overrides(Config(), {**BASE, "model.vocab_size": VOCAB, **overrides})


def _examples(seed: int, count: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random examples: (ids (n,) int32, weights (n - 1,) float32: 1 where the target is trained on), n in 3..T+1."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(3, T + 2))
        weights = (rng.random(n - 1) < 0.6).astype(np.float32)
        weights[-1] = 1.0  # at least one
        out.append((rng.integers(0, VOCAB, n).astype(np.int32), weights))
    return out


def _rows(groups: list[list[tuple[np.ndarray, np.ndarray]]]) -> dict[str, np.ndarray]:
    """A batch of len(groups) rows, row r holding the examples of groups[r] one after another (segments 1, 2, ...;
    padding: segment 0, weight 0)."""
    batch = {k: np.zeros((len(groups), T), np.float32 if k == "weights" else np.int32) for k in batch_keys("chat")}
    for r, group in enumerate(groups):
        at = 0
        for s, (ids, weights) in enumerate(group, start=1):
            n = len(ids) - 1
            assert at + n <= T
            batch["inputs"][r, at:at + n], batch["targets"][r, at:at + n] = ids[:-1], ids[1:]
            batch["weights"][r, at:at + n], batch["segments"][r, at:at + n] = weights, s
            batch["positions"][r, at:at + n] = np.arange(n)
            at += n
    return batch


def _packed_groups(examples) -> list[list]:
    """Next-fit packing in order: what any packer's rows hold, as far as the model can tell."""
    groups, room = [[]], T
    for ex in examples:
        if len(ex[0]) - 1 > room:
            groups.append([])
            room = T
        groups[-1].append(ex)
        room -= len(ex[0]) - 1
    return groups


def _token_sum_and_grads(cfg: Config, params, batch, mesh=None):
    """(the per-token sum of the weighted loss, its gradients), through the train program's own gradient function
    on `mesh` (one device when None)."""
    cfg = apply_overrides(cfg, {"train.global_batch": batch["inputs"].shape[0], "data.format": "text"})
    program = build_train_program(cfg, mesh or make_mesh(cfg.mesh, devices=jax.devices()[:1]), VOCAB)
    placed = jax.device_put(params, program.state_shardings["params"])
    device_batch = {k: jax.device_put(v, program.batch_sharding) for k, v in batch.items()}
    loss, grads = program.grad_fn(placed, device_batch)
    total = float(batch["weights"].sum())
    return float(loss) * total, jax.tree.map(lambda g: np.asarray(g) * total, grads)


def _close(a, b, what):
    np.testing.assert_allclose(a[0], b[0], rtol=TOL, atol=TOL, err_msg=f"{what}: token sum")
    for path, (x, y) in zip(jax.tree_util.tree_leaves_with_path(a[1]),
                            zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1]))):
        scale = max(1.0, float(np.abs(y).max()))
        np.testing.assert_allclose(x, y, rtol=0, atol=TOL * scale, err_msg=f"{what}: gradient {path[0]}")


CASES = {
    "gpt": {},
    "llama": LLAMA,
    "llama_window": {**LLAMA, "model.attention.window": 6},
    "llama_pallas": {**LLAMA, "model.attention.impl": "pallas", "model.attention.window": 6},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_examples_compute_what_they_compute_unpacked(case):
    """Seven random examples (3-33 tokens, random loss weights) packed into rows and one per row: equal token
    sums and gradients, for learned and rotary positions, full and sliding-window attention, the XLA path and the
    Pallas kernel (interpret mode on CPU). Without segment ids (positions alone) the packed examples see each
    other and the sums differ."""
    cfg = _config(**CASES[case])
    params = init_params(cfg.model, jax.random.key(1))
    examples = _examples(seed=2)
    packed, single = _rows(_packed_groups(examples)), _rows([[ex] for ex in examples])
    assert packed["inputs"].shape[0] < single["inputs"].shape[0]  # something was packed
    _close(_token_sum_and_grads(cfg, params, packed), _token_sum_and_grads(cfg, params, single), case)
    if case == "gpt":
        leaky = {**packed, "segments": np.ones_like(packed["segments"])}  # the defect: attention across examples
        assert abs(_token_sum_and_grads(cfg, params, leaky)[0] - _token_sum_and_grads(cfg, params, single)[0]) > 1e-3


@pytest.mark.parametrize("mesh", [{"mesh.data": 2, "mesh.sequence": 2, "mesh.tensor": 2},
                                  {"mesh.data": 2, "mesh.fsdp": 4}])
def test_packed_rows_on_a_mesh_match_one_device(mesh):
    """The packed batch on 8 devices (context parallelism: each sequence shard's queries against gathered keys
    and their gathered segment ids; or FSDP) gives the one-device token sum and gradients."""
    cfg = _config(**LLAMA, **{"model.attention.window": 6})
    params = init_params(cfg.model, jax.random.key(3))
    examples = _examples(seed=4, count=12)
    groups = _packed_groups(examples)
    groups += [[examples[i]] for i in range(-len(groups) % 8)]  # rows: a multiple of the batch split
    packed = _rows(groups)
    on_mesh = _config(**LLAMA, **{"model.attention.window": 6}, **mesh)
    _close(_token_sum_and_grads(on_mesh, params, packed, make_mesh(on_mesh.mesh)),
           _token_sum_and_grads(cfg, params, packed), str(mesh))


def test_a_masked_token_and_another_example_change_nothing():
    """Changing the target of a token of weight 0 changes neither the loss nor the gradients; changing the tokens
    of the row's second example leaves the first example's logits bit for bit."""
    cfg = _config(**LLAMA)
    params = init_params(cfg.model, jax.random.key(5))
    examples = _examples(seed=6, count=3)
    batch = _rows([examples[:2]])
    masked = np.flatnonzero((batch["weights"][0] == 0) & (batch["segments"][0] > 0))[0]
    changed = {**batch, "targets": batch["targets"].copy()}
    changed["targets"][0, masked] = (changed["targets"][0, masked] + 1) % VOCAB
    before, after = _token_sum_and_grads(cfg, params, batch), _token_sum_and_grads(cfg, params, changed)
    assert before[0] == after[0]
    for x, y in zip(jax.tree.leaves(before[1]), jax.tree.leaves(after[1])):
        np.testing.assert_array_equal(x, y)

    from msjax.model import abstract_model

    graphdef = abstract_model(cfg.model)[0]
    first = batch["segments"][0] == 1
    other = batch["inputs"].copy()
    other[0, batch["segments"][0] == 2] = (other[0, batch["segments"][0] == 2] + 7) % VOCAB

    def logits(inputs):
        return np.asarray(apply(graphdef, params, jnp.asarray(inputs),
                                Packing(jnp.asarray(batch["segments"]), jnp.asarray(batch["positions"]))))

    np.testing.assert_array_equal(logits(batch["inputs"])[0, first], logits(other)[0, first])


def test_weighted_loss_with_microbatches_weighs_every_token_the_same():
    """Gradient accumulation over 2 microbatches with uneven numbers of trained tokens gives the loss and gradients
    of one batch: the step's total divides each microbatch's sum (a mean of microbatch means would not)."""
    examples = _examples(seed=7, count=8)
    batch = _rows([[ex] for ex in examples])
    batch["weights"][::2] = 0.0  # microbatch 0 (rows 0, 2, ...) trains on nothing but one token per row
    batch["weights"][::2, 0] = 1.0
    results = []
    for m in (1, 2):
        cfg = _config(**{"train.global_batch": 8, "train.microbatches": m, "data.format": "chat",
                         "data.tokenizer_path": "unused.json"})
        program = build_train_program(cfg, make_mesh(cfg.mesh, devices=jax.devices()[:1]), VOCAB)
        state = program.init_fn(jax.random.key(0))
        new_state, metrics = program.step_fn(state, {k: jnp.asarray(v) for k, v in batch.items()})
        results.append((float(metrics["loss"]), jax.device_get(new_state["params"])))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=TOL)
    for x, y in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1])):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


def test_cross_entropy_weights():
    """The weighted loss is the weighted mean over the trained tokens: against a NumPy computation."""
    rng = np.random.default_rng(8)
    logits, targets = rng.normal(size=(2, 5, 11)).astype(np.float32), rng.integers(0, 11, (2, 5))
    weights = (rng.random((2, 5)) < 0.5).astype(np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    got = float(cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights)))
    np.testing.assert_allclose(got, (nll * weights).sum() / weights.sum(), rtol=1e-6)


@pytest.mark.parametrize("overrides", [{"mesh.pipeline": 2, "mesh.data": 1}, {"mesh.tp_overlap": "collective_matmul"},
                                       {"mesh.rules": "zero2"}, {"model.attention.impl": "cudnn"}])
def test_chat_format_refuses_what_its_batches_cannot_run_on(overrides):
    """data.format=chat with a pipeline, the collective-matmul block, ZeRO-2 or cuDNN attention is one ConfigError
    naming the key; the same config with text data validates."""
    keys = {"data.tokenizer_path": "tok.json", **overrides}
    with pytest.raises(ConfigError, match="data.format=chat"):
        apply_overrides(Config(), {**BASE, **keys, "data.format": "chat"}).validate()
    if "mesh.pipeline" not in overrides and "mesh.tp_overlap" not in overrides:
        apply_overrides(Config(), {**BASE, **keys}).validate()
