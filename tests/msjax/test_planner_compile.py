"""--compile: XLA's per-device argument bytes of the real train step vs the planner's analytic parameter +
optimizer bytes, on small presets across fake-CPU meshes (8 devices in-process via tests/conftest.py; one case
needs 16 and goes through the subprocess)."""

import pytest

from msjax.config import apply_overrides, load_preset
from msjax.planner import PlanOptions, compile_check, make_plan
from msjax.planner.memory import analytic_state_bytes

CASES = [
    # (preset, overrides, devices)
    ("gpt_tiny", {"mesh.fsdp": 8}, 8),
    ("gpt_tiny", {"mesh.tensor": 2, "mesh.fsdp": 4, "optimizer.name": "lamb"}, 8),
    ("gpt_tiny", {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "model.block": "parallel"}, 8),
    ("gpt_tiny", {"mesh.sequence": 2, "mesh.tensor": 2, "mesh.fsdp": 2, "mesh.data": 1}, 8),
    ("gpt_tiny", {"mesh.pipeline": 2, "mesh.tensor": 2, "mesh.fsdp": 2, "mesh.data": 1}, 8),
    ("shakespeare_char", {"model.vocab_size": 65, "mesh.fsdp": 2, "mesh.data": 2}, 4),
    ("gpt_125m", {"mesh.tensor": 4, "mesh.fsdp": 2, "train.global_batch": 16, "train.seq_len": 256}, 8),
]


@pytest.mark.parametrize("preset,overrides,devices", CASES, ids=[
    f"{p}-" + "-".join(f"{k.split('.')[-1]}{v}" for k, v in o.items()) for p, o, _ in CASES])
def test_xla_argument_bytes_match_analytic(preset, overrides, devices):
    cfg = apply_overrides(load_preset(preset), overrides)
    plan = make_plan(cfg, PlanOptions(devices=devices, hardware="a100-80g"))
    check = compile_check(cfg, plan.layout.axis_sizes())
    analytic = check["analytic"]
    assert check["agree"], check
    # the parameter + optimizer part alone is within 1% of XLA's bytes less the batch and scalars
    state = check["xla_argument_bytes"] - analytic["batch"] - analytic["state_scalars"]
    assert state == pytest.approx(analytic["state_params"] + analytic["state_opt_state"], rel=0.01)
    # and the step's own shardings imply the same bytes XLA allocates
    assert check["sharding_bytes"] == check["xla_argument_bytes"]


def test_analytic_global_bytes_match_the_train_program():
    # data=1 x fsdp=1 x tensor=1: per-device bytes are the global sizes the train program reports
    from msjax.mesh import make_mesh
    from msjax.train_step import build_train_program

    cfg = apply_overrides(load_preset("gpt_tiny"), {"mesh.data": 1, "optimizer.name": "lamb"})
    import jax

    prog = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), vocab_size=4096)
    sizes = dict(pipeline=1, data=1, fsdp=1, sequence=1, tensor=1)
    ana = analytic_state_bytes(cfg, 4096, sizes)
    assert ana["params"] == prog.param_bytes
    assert ana["opt_state"] == prog.opt_state_bytes


def test_subprocess_compile_with_more_devices_than_this_process():
    cfg = apply_overrides(load_preset("gpt_tiny"), {"mesh.fsdp": 16})
    check = compile_check(cfg, dict(pipeline=1, data=1, fsdp=16, sequence=1, tensor=1))
    assert check["devices"] == 16 and check["agree"], check
