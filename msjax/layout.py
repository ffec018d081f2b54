"""One resolved layout: every fact derived from a config and its devices, worked out and validated once.

A `Layout` holds what the step builder, the loop, generation, the observers, the launcher's pre-flight check and
the planner all need to agree on: the mesh axis sizes (and the device mesh, when the devices are real), the
pipeline's microbatches and virtual stages, the rule set adjusted for the pipeline, the batch split, the padded
vocabulary, the peak FLOP/s the MFU is measured against and the model FLOPs of one step. Each is derived here and
nowhere else; a rule written twice drifts.

Two ways in:
  `resolve(cfg, devices)`           a run: real devices, a real `jax.sharding.Mesh`.
  `plan(cfg, devices, hardware)`    a dry run: a device count and a catalogue entry (`msjax.hardware`), no mesh.
Both validate with the errors a run gives (`ConfigError` naming the key; the commands exit 2): device-free
checks stay in `Config.validate`, the ones that need the mesh sizes are `check_split` here.

The vocabulary may be unknown until the tokenizer has read the corpus (the `char` tokenizer): such a layout has
`padded_vocab` None and the loop calls `with_vocab(n)` once the data is prepared.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from msjax.config import Config, ConfigError, check_model_split
from msjax.flops import flops_per_token
from msjax.sharding_rules import RULE_SETS, Rules, optimizer_state_rules
from msjax.sharding_rules import axes as ax


def pipeline_rules(rules: Rules, stages: int) -> Rules:
    """The rule set with stacked layers split over `pipeline` (each stage stores its own layers); unchanged for
    one stage."""
    return {**rules, ax.LAYERS: ax.PIPELINE} if stages > 1 else rules


@dataclass(frozen=True)
class BatchSplit:
    """How one step's global batch is divided.

    Attributes:
      global_batch: sequences per optimizer step (`train.global_batch`).
      replicas: data x fsdp x expert, the devices a batch is split over.
      accumulation: gradient-accumulation microbatches (`train.microbatches`).
      pipeline_microbatches: M, microbatches through the pipeline per accumulation microbatch (1 without it).
      microbatch: sequences per (pipeline) microbatch per replica: global_batch / (accumulation x M x replicas).
    """

    global_batch: int
    replicas: int
    accumulation: int
    pipeline_microbatches: int
    microbatch: int

    @property
    def per_replica(self) -> int:
        """Sequences each replica gets per step."""
        return self.global_batch // self.replicas


@dataclass(frozen=True)
class Layout:
    """One config on one set of devices, resolved (module docstring). Build it with `resolve` or `plan`.

    Attributes:
      config: the validated config (model.vocab_size filled in once known, `with_vocab`).
      axis_sizes: mesh axis name -> size, every axis of `msjax.sharding_rules.axes.MESH_AXES`, data=-1 resolved.
      microbatches: M, the pipeline's microbatches per step per replica (1 without pipeline stages).
      virtual_stages: V, model chunks per pipeline stage (1 without pipeline stages).
      rules: the logical-axis rule set of `mesh.rules`, with stacked layers over `pipeline` when it is split.
      state_rules: the rule set of the gradients and optimizer state: `rules`' own, except ZeRO-2's (sharded over
        fsdp where the parameters are replicated); stacked layers over `pipeline` likewise, or every stage would
        hold the whole model's optimizer state.
      batch: the batch split (`BatchSplit`).
      padded_vocab: embedding rows (the vocabulary rounded up to `model.vocab_multiple`), None until known.
      matmul_dtype: the dtype the weight matmuls' operands take on the backend ("float32", "bfloat16":
        `model.matmul_dtype` resolved by `msjax.ops.matmul.resolve`): what a CPU's peak is measured for.
      mesh: the device mesh (`jax.sharding.Mesh`), None for a plan.
      hardware: for a plan, the `msjax.hardware.Hardware` catalogue entry of its devices; None for a run.
    """

    config: Config
    axis_sizes: Mapping[str, int]
    microbatches: int
    virtual_stages: int
    rules: Rules
    state_rules: Rules
    batch: BatchSplit
    padded_vocab: int | None
    matmul_dtype: str
    mesh: Any = None
    hardware: Any = None

    @property
    def stages(self) -> int:
        """P, the pipeline axis size."""
        return self.axis_sizes[ax.PIPELINE]

    @property
    def num_devices(self) -> int:
        return math.prod(self.axis_sizes.values())

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on: global_batch x seq_len."""
        return self.batch.global_batch * self.config.train.seq_len

    @functools.cached_property
    def step_flops(self) -> float:
        """Model FLOPs of one optimizer step (forward + backward, `msjax.flops.flops_per_token` x tokens): the
        MFU numerator's FLOPs per step. Raises ConfigError while the vocabulary is unknown."""
        if self.padded_vocab is None:
            raise ConfigError("model.vocab_size is unknown until the tokenizer has read the corpus")
        return flops_per_token(self.config.model, self.config.train.seq_len) * self.tokens_per_step

    @functools.cached_property
    def peak(self) -> tuple[float, str]:
        """(peak FLOP/s of all the devices together, how it was obtained): the MFU denominator. A run's comes from
        `msjax.hardware.mesh_peak_flops` (on CPU a measured matmul rate, taken once per process); a plan's from
        its catalogue entry x the device count."""
        if self.mesh is not None:
            from msjax.hardware import mesh_peak_flops

            return mesh_peak_flops(self.mesh.devices.flat, self.matmul_dtype)
        hw = self.hardware
        return hw.peak_flops * self.num_devices, f"{hw.name} x {self.num_devices} devices"

    @property
    def peak_flops(self) -> float:
        return self.peak[0]

    def mfu(self, steps_per_s: float) -> float:
        """Model FLOPs utilisation at `steps_per_s` optimizer steps per second: step FLOPs x rate / peak."""
        return self.step_flops * steps_per_s / self.peak_flops

    @property
    def batch_spec(self):
        """PartitionSpec of a (B, T) batch array (logical axes act_batch, act_seq under `rules`)."""
        from msjax.sharding_rules import logical_to_mesh_spec

        return logical_to_mesh_spec((ax.ACT_BATCH, ax.ACT_SEQ), self.rules)

    def with_vocab(self, vocab_size: int | None) -> "Layout":
        """This layout with the tokenizer's vocabulary: model.vocab_size filled in when it is 0, checked against
        the tensor axis. Raises ConfigError: a tokenizer larger than model.vocab_size, no vocabulary at all, or a
        padded vocabulary the tensor axis does not divide."""
        m = self.config.model
        if vocab_size:
            if m.vocab_size and vocab_size > m.vocab_size:
                raise ConfigError(f"the tokenizer has {vocab_size} tokens but model.vocab_size={m.vocab_size}")
            m = dataclasses.replace(m, vocab_size=m.vocab_size or vocab_size)
        if m.vocab_size < 1:
            raise ConfigError("model.vocab_size is 0 and no tokenizer vocabulary was given")
        tp = self.axis_sizes[ax.TENSOR]
        if m.padded_vocab() % tp:
            raise ConfigError(f"model.vocab_multiple={m.vocab_multiple} pads the {m.vocab_size}-token vocabulary "
                              f"to {m.padded_vocab()} rows, which mesh.tensor={tp} does not divide; set "
                              "model.vocab_multiple to a multiple of mesh.tensor")
        new = dataclasses.replace(self, config=dataclasses.replace(self.config, model=m),
                                  padded_vocab=m.padded_vocab())
        return new


def resolve_axis_sizes(cfg: Config, num_devices: int) -> dict[str, int]:
    """Axis sizes with `data=-1` filled in for `num_devices`. Raises ConfigError when the sizes do not multiply
    to the device count."""
    from msjax.mesh import resolve_axis_sizes as sizes_of

    return sizes_of(cfg.mesh, num_devices)


def split_batch(cfg: Config, sizes: Mapping[str, int]) -> BatchSplit:
    """The batch split of `cfg` on mesh `sizes`. Raises ConfigError when a (pipeline) microbatch does not split
    over the data-parallel devices (`Config.validate` has checked the device-free divisibility)."""
    t = cfg.train
    replicas = math.prod(sizes[a] for a in ax.BATCH_AXES)
    m = cfg.pipeline_microbatches(sizes[ax.PIPELINE])
    micro = t.global_batch // t.microbatches
    if (micro // m) % replicas:
        pipe = f" / pipeline.microbatches={m}" if sizes[ax.PIPELINE] > 1 else ""
        raise ConfigError(f"microbatch of {micro // m} sequences (train.global_batch={t.global_batch} / "
                          f"train.microbatches={t.microbatches}{pipe}) does not split over data x fsdp x expert = "
                          f"{replicas} devices")
    return BatchSplit(t.global_batch, replicas, t.microbatches, m, micro // m // replicas)


def _known_vocab(cfg: Config) -> int | None:
    """The vocabulary before the data is read: model.vocab_size, else the tokenizer's fixed size (bpe:
    data.bpe_vocab_size; byte: 256); None for `char`, whose size depends on the corpus."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    return {"bpe": cfg.data.bpe_vocab_size, "byte": 256}.get(cfg.data.tokenizer)


def _build(cfg: Config, sizes: dict[str, int], platform: str | None, mesh: Any, hardware: Any,
           vocab_size: int | None, strict: bool = True) -> Layout:
    from msjax.ops import matmul

    if strict:
        cfg = cfg.validate()
        check_model_split(cfg, sizes)
    p = sizes[ax.PIPELINE]
    layout = Layout(
        config=cfg, axis_sizes=sizes, microbatches=cfg.pipeline_microbatches(p),
        virtual_stages=cfg.pipeline.virtual_stages if p > 1 else 1,
        rules=pipeline_rules(RULE_SETS[cfg.mesh.rules], p),
        state_rules=pipeline_rules(optimizer_state_rules(cfg.mesh.rules), p), batch=split_batch(cfg, sizes),
        padded_vocab=None, matmul_dtype=matmul.resolve(cfg.model.matmul_dtype, cfg.model.dtype, platform).name,
        mesh=mesh, hardware=hardware,
    )
    if vocab_size or cfg.model.vocab_size:
        return layout.with_vocab(vocab_size)
    if _known_vocab(cfg):  # checked now, before any data is read; filled in from the tokenizer (`with_vocab`)
        layout.with_vocab(_known_vocab(cfg))
    return layout


def resolve(cfg: Config, devices: Sequence[Any] | None = None, *, mesh: Any = None,
            vocab_size: int | None = None, strict: bool = True) -> Layout:
    """The layout of a run of `cfg` on real devices.

    Args:
      cfg: the config (validated here).
      devices: the devices of the mesh (default: every process's, `jax.devices()`); ignored with `mesh`.
      mesh: an existing device mesh to use instead of building one (`msjax.mesh.make_mesh`).
      vocab_size: the tokenizer's vocabulary (fills model.vocab_size when it is 0); None: as the config says.
      strict: validate the config and check the model's split over the mesh, rule set included
        (`msjax.config.check_model_split`), as a run does. False: the low-level program builder's contract, which
        builds the config it is given as it is (equivalence tests run every rule set on one mesh); the mesh and
        the batch split are checked either way.
    Raises:
      ConfigError: a config that does not validate, a mesh that does not match the devices, a model or batch
        that does not split over it, or a vocabulary that does not fit (`Layout.with_vocab`).
    """
    from msjax.mesh import make_mesh

    if strict:
        cfg = cfg.validate()
    if mesh is None:
        mesh = make_mesh(cfg.mesh, devices)
    sizes = {name: int(size) for name, size in mesh.shape.items()}
    platform = mesh.devices.flat[0].platform
    return _build(cfg, sizes, platform, mesh, None, vocab_size, strict)


def plan(cfg: Config, devices: int, hardware: Any, vocab_size: int | None = None) -> Layout:
    """The layout `cfg` would have on `devices` devices of catalogue entry `hardware` (`msjax.hardware.Hardware`),
    allocating nothing: for dry runs and pre-flight checks. Raises ConfigError as `resolve` does."""
    cfg = cfg.validate()
    sizes = resolve_axis_sizes(cfg, devices)
    platform = "cpu" if hardware.name == "cpu" else ("tpu" if hardware.name.startswith("tpu") else "gpu")
    return _build(cfg, sizes, platform, None, hardware, vocab_size)
