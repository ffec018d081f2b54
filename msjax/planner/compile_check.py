"""`--compile`: lower and compile the real train step for a layout on fake CPU devices, and compare XLA's
per-device argument bytes with the planner's analytic parameter + optimizer-state bytes.

What is compiled (no accelerator; `XLA_FLAGS=--xla_force_host_platform_device_count=N` in a subprocess, or the
current process when it already has enough devices):
  `msjax.train_step.build_train_program(cfg, mesh).step_fn`, lowered with the abstract state and batch and
  compiled; `compiled.memory_analysis().argument_size_in_bytes` is per device.
  The mesh is the layout's (fsdp, sequence, tensor) with data = 1: data-parallel replicas hold identical bytes,
  so one replica's worth of devices is enough. The global batch is divided by the data size to keep the
  per-device batch the same.
  With pipeline > 1 the mesh keeps its pipeline axis and the compiled step is the real pipelined one
  (msjax.parallel.pipeline, interleaved 1F1B). ZeRO-1/2 over `data` are not in the train step: the
  comparison is always with the state as the step lays it out (ZeRO over data = 0).
What is compared:
  analytic: params + optimizer moments + scalars (step, rng, optimizer counters), per device, from the
    planner's own leaf inventory and the rule set (msjax.planner.memory.analytic_state_bytes), plus the int32
    inputs/targets batch shard.
  xla: the compiled step's argument bytes per device.
  They must agree within 1%.
The whole step's memory: the planner's per-device estimate of the step as compiled (`step_estimate`,
msjax.planner.memory's phases and transient buffers) beside XLA's argument + temp + output - alias bytes
(`memory_analysis()`: every buffer the step needs, the outputs written into donated arguments counted once), and
with `live` XLA's own peak of simultaneously live bytes (`xla_live_peak`), which the temp allocation exceeds by
the holes its packing leaves (`msjax.planner.memory.HEAP_PACKING`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

from msjax import runtime
from msjax.config import Config, apply_overrides, flat_keys
from msjax.planner.layout import AXES, resolve_vocab
from msjax.planner.memory import analytic_state_bytes
from msjax.planner.options import PlanError

MAX_FAKE_DEVICES = 512


def compile_config(cfg: Config, sizes: dict[str, int], pipeline_microbatches: int = 0,
                   virtual_stages: int = 0) -> tuple[Config, dict[str, int], str]:
    """(config to compile, its mesh sizes, a sentence saying what is compiled) for a layout's `sizes`; with
    pipeline stages, `pipeline_microbatches` / `virtual_stages` (0: the config's) set the plan's M and V."""
    if sizes["pipeline"] > 1 and (pipeline_microbatches or virtual_stages):
        cfg = apply_overrides(cfg, {"pipeline.microbatches": pipeline_microbatches or cfg.pipeline.microbatches,
                                    "pipeline.virtual_stages": virtual_stages or cfg.pipeline.virtual_stages,
                                    "train.microbatches": 1})
    p, d = sizes["pipeline"], sizes["data"]
    g = cfg.train.global_batch // d
    pm = cfg.pipeline_microbatches(p)
    micro = cfg.train.microbatches if g % (cfg.train.microbatches * pm) == 0 and \
        (g // (cfg.train.microbatches * pm)) % sizes["fsdp"] == 0 else 1
    over = {"mesh.pipeline": 1, "mesh.data": 1, "mesh.fsdp": sizes["fsdp"], "mesh.sequence": sizes["sequence"],
            "mesh.tensor": sizes["tensor"], "train.global_batch": g, "train.microbatches": micro,
            "model.vocab_size": resolve_vocab(cfg) if not cfg.model.vocab_size else cfg.model.vocab_size}
    what = (f"the train step of {cfg.name} on a (data=1, fsdp={sizes['fsdp']}, sequence={sizes['sequence']}, "
            f"tensor={sizes['tensor']}) mesh of {sizes['fsdp'] * sizes['sequence'] * sizes['tensor']} fake CPU "
            f"devices (one of the {d} data-parallel replicas; batch {g})")
    if p > 1:
        over["mesh.pipeline"] = p
        m = pm
        what = what.replace("(data=1,", f"(pipeline={p}, data=1,").replace(
            f"of {sizes['fsdp'] * sizes['sequence'] * sizes['tensor']} fake",
            f"of {p * sizes['fsdp'] * sizes['sequence'] * sizes['tensor']} fake")
        schedule = "interleaved 1F1B" if cfg.pipeline.schedule == "interleaved" else cfg.pipeline.schedule
        what += (f"; the pipelined step: {schedule}, V={cfg.pipeline.virtual_stages}, M={m} microbatches of "
                 f"{g // (micro * m)} sequences")
    csizes = {"pipeline": p, "data": 1, "fsdp": sizes["fsdp"], "expert": sizes.get("expert", 1),
              "sequence": sizes["sequence"], "tensor": sizes["tensor"]}
    return apply_overrides(cfg, over).validate(), csizes, what


def analytic_bytes(cfg: Config, sizes: dict[str, int]) -> dict[str, int]:
    """Analytic per-device argument bytes of the train step: state (params, optimizer, scalars) + batch shard."""
    state = analytic_state_bytes(cfg, resolve_vocab(cfg), sizes)
    shards = sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1) * sizes["sequence"]
    batch = 2 * 4 * cfg.train.global_batch * cfg.train.seq_len // shards
    return {**{f"state_{k}": v for k, v in state.items()}, "batch": batch, "total": state["total"] + batch}


def compile_here(cfg: Config, sizes: dict[str, int], live: bool = False) -> dict[str, Any]:
    """Compiles in this process (needs prod(sizes) local devices) and returns the comparison dict; `live` also
    reads XLA's peak of live bytes from a dump of the compiled module (`xla_live_peak`; compiles uncached)."""
    import jax

    from msjax.mesh import make_mesh
    from msjax.train_step import build_train_program

    n = math.prod(sizes.values())
    devices = jax.devices()[:n]
    if len(devices) < n:
        raise PlanError(f"compile check needs {n} devices, this process has {len(jax.devices())}")
    t0 = time.perf_counter()
    mesh = make_mesh(cfg.mesh, devices)
    prog = build_train_program(cfg, mesh)
    lowered = prog.step_fn.lower(prog.abstract_state, prog.abstract_batch)
    live_peak = None
    if live:
        # the persistent compilation cache would hand back an executable without compiling, so without the dump
        with tempfile.TemporaryDirectory(prefix="msjax-compile-check-") as dump, without_compilation_cache():
            compiled = lowered.compile(compiler_options=_dump_options(dump))
            live_peak = xla_live_peak(dump)
    else:
        compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    xla = int(mem.argument_size_in_bytes)
    sharded = 0  # bytes per device implied by the step's own shardings (an independent middle check)
    leaves = jax.tree_util.tree_flatten_with_path((prog.abstract_state, prog.abstract_batch))[0]
    for path, leaf in leaves:
        # optax.apply_if_finite's `last_finite` (a bool) is overwritten by every update and never read: XLA
        # drops that dead argument, so it is not among the bytes XLA allocates (measured: exactly 1 byte less).
        if jax.tree_util.keystr(path).endswith(".last_finite"):
            continue
        sharded += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    analytic = analytic_bytes(cfg, sizes)
    est = step_estimate(cfg, sizes)
    # every buffer of the step at once, less the outputs written into donated arguments: the peak's upper bound
    bound = int(mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                - mem.alias_size_in_bytes)
    return {"devices": n, "mesh": sizes, "compile_seconds": seconds, "xla_argument_bytes": xla,
            "xla_temp_bytes": int(mem.temp_size_in_bytes), "xla_output_bytes": int(mem.output_size_in_bytes),
            "xla_alias_bytes": int(mem.alias_size_in_bytes), "xla_live_peak_bytes": live_peak,
            "xla_peak_bound_bytes": bound, "estimate": est, "estimate_ratio": est["total"] / bound,
            "sharding_bytes": sharded, "analytic": analytic,
            "param_bytes_global": prog.param_bytes, "opt_state_bytes_global": prog.opt_state_bytes,
            "relative_difference": (xla - analytic["total"]) / analytic["total"]}


@contextlib.contextmanager
def without_compilation_cache() -> Iterator[None]:
    """jax's persistent compilation cache off for the enclosed compiles (jax decides once per process whether the
    cache is used, so the decision is reset on the way in and out)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def _dump_options(directory: str) -> dict[str, Any]:
    """XLA debug options (per compile, `Lowered.compile(compiler_options=...)`) that write the compiled module's
    buffer assignment and live ranges into `directory`."""
    return {"xla_dump_to": directory, "xla_dump_hlo_as_text": True, "xla_dump_buffer_assignment_analysis": True,
            "xla_dump_hlo_module_re": ".*train_step.*"}


def xla_live_peak(directory: str) -> int | None:
    """XLA's peak of simultaneously live bytes per device (arguments included) for the module dumped in
    `directory`: the figure of HloLiveRange's "Stack trace breakdown for peak usage: N bytes" line in the
    `*-live-range.txt` dump (what the buffers need at the step's worst instruction, before the heap simulator
    packs them into the temp allocation; `memory_analysis()`'s temp is that packing, 0-20% larger on the tiny
    layouts). None when the dump has no such line."""
    for path in sorted(glob.glob(os.path.join(directory, "*train_step*live-range.txt"))):
        with open(path) as f:
            match = re.search(r"peak usage: ([\d ]+) bytes", f.read())
        if match:
            return int(match.group(1).replace(" ", ""))
    return None


def step_estimate(cfg: Config, sizes: dict[str, int]) -> dict[str, float]:
    """The planner's per-device memory of the step as compiled (`msjax.planner.preflight.estimate`: ZeRO over
    data 0, the config's microbatches and virtual stages), by part, bytes."""
    from msjax.planner.preflight import cpu_hardware, estimate

    r = estimate(cfg, sizes, cpu_hardware(0.0), 0.0)
    return {"params": r.params, "grads": r.grads, "optimizer": r.optimizer, "activations": r.activations,
            "working": r.working, "total": r.total}


def compile_check(cfg: Config, sizes: dict[str, int], zero_stage: int = 0,
                  timeout: float = 600.0, pipeline_microbatches: int = 0,
                  virtual_stages: int = 0, live: bool = False) -> dict[str, Any]:
    """Compiles the train step for a layout (see module docstring) and compares argument bytes.

    Args:
      cfg: the planned config.
      sizes: the layout's mesh axis sizes (pipeline, data, fsdp, sequence, tensor).
      zero_stage: the plan's ZeRO stage over data (only mentioned: the step keeps the state whole over data).
      pipeline_microbatches, virtual_stages: the plan's M and V for a pipelined layout (0: the config's).
      live: also read XLA's peak of live bytes ("xla_live_peak_bytes", `xla_live_peak`; else None).
    Returns:
      dict with "what" (the sentence above), "xla_argument_bytes", "analytic" (by part), "sharding_bytes",
      "relative_difference", "agree" (within 1%), "compile_seconds", "devices", "mesh"; the memory comparison:
      "xla_temp_bytes", "xla_output_bytes", "xla_alias_bytes", "xla_peak_bound_bytes" (argument + temp +
      output - alias), "estimate" (the planner's per-device memory of the compiled step, by part) and
      "estimate_ratio" (estimate total / xla_peak_bound_bytes).
    Raises:
      PlanError: more than MAX_FAKE_DEVICES devices would be needed, or the subprocess failed (its stderr
        tail is in the message).
    """
    ccfg, csizes, what = compile_config(cfg, sizes, pipeline_microbatches, virtual_stages)
    n = math.prod(csizes.values())
    if n > MAX_FAKE_DEVICES:
        raise PlanError(f"compile check would need {n} fake CPU devices (fsdp x sequence x tensor); at most "
                        f"{MAX_FAKE_DEVICES} are supported")
    try:
        import jax

        local = len(jax.devices()) if "jax" in sys.modules else 0
    except Exception:  # noqa: BLE001 - no usable jax backend here: use the subprocess
        local = 0
    # The planner's memory model is fitted to steps compiled by XLA:CPU's default scheduler; a process that runs
    # without it (msjax turns it off with several CPU devices: msjax.runtime.order_cpu_collectives) compiles in a
    # subprocess that keeps it, as it would with too few devices.
    if local >= n and runtime.concurrent_scheduler_on():
        out = compile_here(ccfg, csizes, live)
    else:
        out = _compile_subprocess(ccfg, csizes, n, timeout, live)
    if zero_stage:
        what += (f"; the plan's ZeRO-{zero_stage} over data is not in the train step, so both sides are the "
                 "state as the step lays it out (whole over data)")
    out["what"] = what
    out["agree"] = abs(out["relative_difference"]) <= 0.01
    return out


def _compile_subprocess(cfg: Config, sizes: dict[str, int], n: int, timeout: float,
                        live: bool = False) -> dict[str, Any]:
    env = dict(os.environ)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                     if "host_platform_device_count" not in f and runtime.CPU_CONCURRENT_SCHEDULER not in f)
    # Compiled, never run: XLA:CPU's default scheduler, the one the planner's memory model is fitted to.
    env["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count={n}"
                        f" --{runtime.CPU_CONCURRENT_SCHEDULER}=true").strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    payload = json.dumps({"config": {k: v for k, v in flat_keys(cfg).items()}, "name": cfg.name, "sizes": sizes,
                          "live": live})
    proc = subprocess.run([sys.executable, "-m", "msjax.planner.compile_check"], input=payload, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise PlanError(f"compile check failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main() -> None:
    msg = json.loads(sys.stdin.read())
    cfg = apply_overrides(Config(name=msg["name"]), {k: (list(v) if isinstance(v, list) else v)
                                                     for k, v in msg["config"].items()}).validate()
    sizes = {a: int(msg["sizes"][a]) for a in AXES}
    print(json.dumps(compile_here(cfg, sizes, bool(msg.get("live")))))


if __name__ == "__main__":
    _main()
