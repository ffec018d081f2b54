"""Hugging Face model directory <-> msjax run directory.

Import (`import_hf`): config.json -> an msjax Config; the safetensors are read one tensor at a time
(`safetensors.safe_open`, memory-mapped; the flax backend because NumPy has no bfloat16) and each tensor is
placed straight onto its shards of the mesh, so the host holds one tensor beyond the model's own shards; and the
parameters (with the step and the run's random key) are written as a verified msjax checkpoint of step 0
(`msjax.checkpoint.Checkpointer`, the one training writes), with config.json and tokenizer.json beside it. No
optimizer state is made or written: under AdamW it is twice the parameters' bytes of zeros, which training makes
itself when it resumes from a checkpoint without one (`msjax.train`), and which generation and export never
read. The run
directory is built under a temporary name and renamed into place at the end: a failed conversion leaves nothing
that looks like a run.

Export (`export_hf`): the run's newest verified checkpoint (restored onto any mesh, `msjax.runs.restore_params`)
-> safetensors shards of at most `max_shard_bytes`, each tensor fetched from the devices when its shard is written,
with model.safetensors.index.json when there are several (the layout `save_pretrained` writes), config.json,
generation_config.json and the tokenizer files (`msjax.hf.tokenizer`). Same temporary-name-then-rename rule.

Why safetensors (the `safetensors` library) and not torch's pickles: it is the format `transformers` writes by
default, it is readable lazily per tensor, and reading it runs no code.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from msjax.config import Config, apply_overrides, to_dict
from msjax.hf.arch import (IGNORED_SUFFIXES, HFConversionError, architecture_for, canonical_name, hf_config_for,
                           hf_name_in_file, model_overrides_from_hf, rules)
from msjax.chat import HF_DIR
from msjax.hf.tokenizer import KEPT_FILES, special_token_ids, write_tokenizer

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 << 30
KEPT_DIR = HF_DIR  # <run_dir>/hf/: the imported model's tokenizer_config.json & co, written back on export


# ---------------------------------------------------------------------------------------------------------------
# Reading a HF directory.


class SafetensorsReader:
    """The tensors of a HF model directory (model.safetensors, or the shards an index names), read lazily.

    Raises:
      HFConversionError: no safetensors (PyTorch .bin files only: convert them with `transformers` first), an
        index naming a missing file.
    """

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        index = hf_dir / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (hf_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            bins = sorted(p.name for p in hf_dir.glob("*.bin"))
            raise HFConversionError(f"{hf_dir}: no model.safetensors or {SAFETENSORS_INDEX}" + (
                f" (found {', '.join(bins)}: PyTorch pickles are not read; save the model with "
                "`save_pretrained(dir, safe_serialization=True)` first)" if bins else ""))
        self.directory = hf_dir
        self._files = {}
        self.where: dict[str, str] = {}
        for name in files:
            path = hf_dir / name
            if not path.is_file():
                raise HFConversionError(f"{index}: names {name}, which is not in {hf_dir}")
            f = safe_open(str(path), framework="flax")
            self._files[name] = f
            for key in f.keys():
                self.where[key] = name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self.where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> jax.Array:
        """One tensor, on the default device (a jax array: NumPy has no bfloat16)."""
        return self._files[self.where[name]].get_tensor(name)


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise HFConversionError(f"{path.parent}: no {path.name} ({what})")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFConversionError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise HFConversionError(f"{path}: not a JSON object")
    return doc


def hf_run_config(hf_dir: Path, run_dir: Path, base: Config | None = None,
                  overrides: dict[str, Any] | None = None) -> tuple[str, Config]:
    """(architecture, the msjax Config of the converted run): `base` (default: the defaults), the model from
    config.json, the run directory, a tokenizer_path onto the run's tokenizer.json when the model has one,
    train.seq_len no longer than the model's positions; then `overrides` (flags), validated.

    Raises:
      HFConversionError / ConfigError: as `model_overrides_from_hf`, or an override that does not validate.
    """
    hf = _read_json(hf_dir / "config.json", "a Hugging Face model directory has its config.json")
    arch, model = model_overrides_from_hf(hf, str(hf_dir / "config.json"))
    base = base or Config(name=f"hf-{hf_dir.resolve().name}")
    keys = {**model, "train.run_dir": str(run_dir),
            "train.seq_len": min(base.train.seq_len, model["model.max_seq_len"])}
    if (hf_dir / "tokenizer.json").is_file():
        keys.update({"data.tokenizer": "bpe", "data.tokenizer_path": str(run_dir / "tokenizer.json"),
                     "data.bpe_vocab_size": model["model.vocab_size"]})
    cfg = apply_overrides(apply_overrides(base, keys), overrides or {}).validate()
    return arch, cfg


def _params_of(tree: dict, path: str, layer: int | None, scan: bool, expert: int | None = None
               ) -> tuple[dict, str, tuple[int, ...]]:
    """(the dict holding the leaf, its key, the rule's indices on its leading axes: the `layers` axis of stacked
    layers, then an expert's on the `exp` axis; () for the whole leaf)."""
    parts = path.split(".")
    if layer is None:
        node = tree
    elif scan:
        node = tree["blocks"]
    else:
        node = tree["layers"][layer]
    for part in parts[:-1]:
        node = node[part]
    index = ((layer,) if (layer is not None and scan) else ()) + ((expert,) if expert is not None else ())
    return node, parts[-1], index


def load_hf_params(reader: SafetensorsReader, arch: str, cfg: Config, abstract_params: dict,
                   shardings: dict) -> dict:
    """The model's parameters from the HF tensors, each placed on its shards as it is read.

    Args:
      reader: the HF directory's tensors.
      arch: GPT2 or LLAMA.
      cfg: the run's config (its model section decides the layout: stacked `blocks` or per-layer `layers`).
      abstract_params, shardings: the parameters' ShapeDtypeStructs and NamedShardings (the train program's).
    Returns:
      The parameters, a nested dict like `abstract_params`, in model.param_dtype.
    Raises:
      HFConversionError: a missing tensor, a tensor of the wrong shape, or tensors left over (naming them).
    """
    m = cfg.model
    dt = jnp.dtype(m.param_dtype)
    by_name = {canonical_name(arch, n): n for n in reader.where}
    used: set[str] = set()
    params: dict = jax.tree.map(lambda a: None, abstract_params)

    def placed(abstract, sharding, value):
        if value.shape != abstract.shape:
            raise ValueError(f"shape {value.shape}, needs {abstract.shape}")
        return jax.device_put(value.astype(dt), sharding)

    set_slice = jax.jit(lambda stack, x, i: stack.at[tuple(i)].set(x), donate_argnums=0)
    for rule in rules(arch, m):
        if rule.hf not in by_name:
            raise HFConversionError(f"{reader.directory}: tensor {hf_name_in_file(arch, rule.hf)!r} is missing "
                                    f"(config.json describes {m.num_layers} layers of {arch}"
                                    + (", untied output projection" if not m.tie_embeddings else "") + ")")
        name = by_name[rule.hf]
        used.add(name)
        values = rule.to_msjax(reader.get(name))
        for path, value in zip(rule.params, values):
            node, key, index = _params_of(params, path, rule.layer, m.scan_layers, rule.expert)
            a_node, _, _ = _params_of(abstract_params, path, rule.layer, m.scan_layers)
            s_node, _, _ = _params_of(shardings, path, rule.layer, m.scan_layers)
            abstract, sharding = a_node[key], s_node[key]
            try:
                if not index:
                    node[key] = placed(abstract, sharding, value)
                else:
                    if node[key] is None:  # the stacked (L, ...) / (E, ...) array, filled slice by slice in place
                        node[key] = jax.jit(lambda: jnp.zeros(abstract.shape, dt), out_shardings=sharding)()
                    part = jax.ShapeDtypeStruct(abstract.shape[len(index):], dt)
                    if value.shape != part.shape:
                        raise ValueError(f"shape {value.shape}, needs {part.shape}")
                    node[key] = set_slice(node[key], value.astype(dt), jnp.asarray(index, jnp.int32))
            except ValueError as e:
                raise HFConversionError(f"{reader.directory}: tensor {name!r} (shape {reader.shape(name)}) does "
                                        f"not fit msjax's {path} of layer {rule.layer}: {e}") from None
        del values
    left = sorted(n for n in reader.where if n not in used and not n.endswith(IGNORED_SUFFIXES))
    if m.tie_embeddings:
        left = [n for n in left if canonical_name(arch, n) != "lm_head.weight"]  # a tied copy some files keep
    if left:
        raise HFConversionError(f"{reader.directory}: tensors msjax has no place for: {', '.join(left[:8])}"
                                + (f" (+{len(left) - 8} more)" if len(left) > 8 else "")
                                + "; config.json does not describe this checkpoint")
    missing = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: x is None)[0] if x is None]
    if missing:  # a rule list that does not cover the model: a bug here, not the user's input
        raise AssertionError(f"parameters not filled from {arch}: {missing}")
    return params


# ---------------------------------------------------------------------------------------------------------------
# Directories that appear whole or not at all.


def local_path(path: str | Path, flag: str) -> Path:
    """`path` as a local path; raises HFConversionError for a URL or any `scheme://` path (conversion reads and
    writes local directories: download a model first, copy the result after)."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(path)):
        raise HFConversionError(f"{flag}={str(path)!r} is a URL; conversion reads and writes local directories "
                                "(get a model with `huggingface-cli download NAME --local-dir DIR`)")
    return Path(path)


def _fresh_target(path: Path, flag: str) -> Path:
    """A temporary sibling of `path` to build into; raises HFConversionError when `path` exists and is not an
    empty directory (nothing is overwritten)."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise HFConversionError(f"{flag}={str(path)!r} already exists and is not empty; give a new directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _publish(tmp: Path, path: Path) -> None:
    if path.is_dir():
        path.rmdir()  # empty (checked by _fresh_target)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# Import.


@dataclasses.dataclass
class ImportResult:
    """What `import_hf` made: the run directory, its config, the architecture, the parameter count, seconds."""

    run_dir: Path
    config: Config
    arch: str
    param_count: int
    seconds: float


def import_hf(hf_dir: str | Path, run_dir: str | Path, base: Config | None = None,
              overrides: dict[str, Any] | None = None, devices: Sequence[jax.Device] | None = None) -> ImportResult:
    """Converts a local Hugging Face model directory into an msjax run directory (module docstring).

    Args:
      hf_dir: config.json + model.safetensors (or shards with model.safetensors.index.json), and tokenizer.json
        when there is one (e.g. `huggingface-cli download meta-llama/Meta-Llama-3-8B --local-dir DIR`).
      run_dir: the run directory to create (must not exist, or be empty).
      base: the config the model section is applied to (default: msjax's defaults).
      overrides: dotted keys applied last (e.g. the mesh, train.steps, optimizer.lr).
      devices: the mesh's devices (default: all).
    Returns:
      ImportResult.
    Raises:
      HFConversionError: an unsupported architecture or field, missing/unknown/misshapen tensors, an existing
        run directory (each naming the field, tensor or path).
      ConfigError: overrides that do not validate, a mesh that does not fit the devices.
    """
    from msjax.checkpoint import Checkpointer, checkpoint_dir
    from msjax.data import HFTokenizer
    from msjax.mesh import make_mesh
    from msjax.train_step import build_train_program

    t0 = time.perf_counter()
    hf_dir, run_dir = local_path(hf_dir, "--from_hf"), local_path(run_dir, "--run_dir")
    if not hf_dir.is_dir():
        raise HFConversionError(f"--from_hf={str(hf_dir)!r} is not a directory (download one with "
                                "`huggingface-cli download NAME --local-dir DIR`)")
    arch, cfg = hf_run_config(hf_dir, run_dir, base, overrides)
    reader = SafetensorsReader(hf_dir)
    tokenizer = None
    if (hf_dir / "tokenizer.json").is_file():
        tokenizer = HFTokenizer.from_file(hf_dir / "tokenizer.json")
        if tokenizer.vocab_size > cfg.model.vocab_size:
            raise HFConversionError(f"{hf_dir}/tokenizer.json has {tokenizer.vocab_size} tokens but config.json's "
                                    f"vocab_size is {cfg.model.vocab_size}")
    else:
        log.warning("%s has no tokenizer.json: the run has no tokenizer (training needs --data.tokenizer_path, "
                    "generation token ids)", hf_dir)
    mesh = make_mesh(cfg.mesh, devices)
    program = build_train_program(cfg, mesh)
    cfg = program.config
    shardings = program.state_shardings
    params = load_hf_params(reader, arch, cfg, jax.tree.map(lambda a: a, program.abstract_state["params"]),
                            shardings["params"])
    # The step and random key of a fresh state, exactly as a new run makes them (msjax.train_step: init).
    params_key, run_key = jax.random.split(jax.random.key(cfg.train.seed))
    del params_key
    state = {"step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"]), "params": params,
             "rng": jax.device_put(jax.random.key_data(run_key), shardings["rng"])}

    tmp = _fresh_target(run_dir, "--run_dir")
    try:
        # The checkpoint is written where it will live once the directory is renamed, so checkpoint.dir (when it
        # is not set) points into the temporary directory until then.
        ckpt_cfg = dataclasses.replace(cfg.checkpoint, async_save=False)
        ckpt = Checkpointer(ckpt_cfg, checkpoint_dir(ckpt_cfg, str(tmp)))
        try:
            ckpt.save(0, state, {"step": 0, "seed": cfg.data.seed}, force=True, config=to_dict(cfg))
            ckpt.wait()
        finally:
            ckpt.close()
        (tmp / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer.json")
        kept = [n for n in KEPT_FILES if (hf_dir / n).is_file()]
        if kept:
            (tmp / KEPT_DIR).mkdir()
            for name in kept:
                shutil.copyfile(hf_dir / name, tmp / KEPT_DIR / name)
        _publish(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ImportResult(run_dir, cfg, arch, program.param_count, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------------------------
# Export.


@dataclasses.dataclass
class ExportResult:
    """What `export_hf` wrote: the directory, the architecture, the checkpoint step, the files, seconds."""

    out_dir: Path
    arch: str
    step: int
    files: list[str]
    seconds: float


def hf_tensors(arch: str, cfg: Config, params: dict, dtype: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name in the HF checkpoint, host array) for every tensor of the model, each fetched from the devices when
    it is reached (a layer's slice of a stacked parameter alone)."""
    out_dt = jnp.dtype(dtype)
    m = cfg.model

    def fetch(path: str, layer: int | None, expert: int | None) -> np.ndarray:
        node, key, index = _params_of(params, path, layer, m.scan_layers, expert)
        x = node[key][index] if index else node[key]
        return np.asarray(jax.device_get(x))

    for rule in rules(arch, m):
        value = rule.to_hf([fetch(p, rule.layer, rule.expert) for p in rule.params])
        yield hf_name_in_file(arch, rule.hf), np.ascontiguousarray(np.asarray(value).astype(out_dt))


def write_safetensors(tensors: Iterator[tuple[str, np.ndarray]], out_dir: Path, max_shard_bytes: int
                      ) -> list[str]:
    """Writes tensors into model.safetensors, or shards `model-0000i-of-0000n.safetensors` of at most
    `max_shard_bytes` (one tensor larger than that gets a shard of its own) plus the index `transformers`
    reads. Holds one shard's tensors in host memory at a time. Returns the file names written."""
    from safetensors.flax import save_file  # the flax writer: NumPy's writer takes no bfloat16

    cpu = jax.devices("cpu")[0]
    shards: list[list[str]] = []
    weight_map: dict[str, int] = {}
    current: dict[str, np.ndarray] = {}
    size, total = 0, 0
    part = 0

    def flush():
        nonlocal current, size, part
        if current:
            part += 1
            save_file({k: jax.device_put(v, cpu) for k, v in current.items()}, str(out_dir / f"part-{part}"),
                      metadata={"format": "pt"})
            shards.append(list(current))
            current, size = {}, 0

    for name, value in tensors:
        if current and size + value.nbytes > max_shard_bytes:
            flush()
        current[name] = value
        size += value.nbytes
        total += value.nbytes
        weight_map[name] = part + 1
    flush()
    if len(shards) == 1:
        os.replace(out_dir / "part-1", out_dir / "model.safetensors")
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, name in enumerate(names):
        os.replace(out_dir / f"part-{i + 1}", out_dir / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[v - 1] for k, v in weight_map.items()}}
    (out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    return names + [SAFETENSORS_INDEX]


def export_hf(run_dir: str | Path, out_dir: str | Path, overrides: dict[str, Any] | None = None,
              dtype: str = "float32", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              devices: Sequence[jax.Device] | None = None, config: Config | None = None) -> ExportResult:
    """Writes a run's newest verified checkpoint as a Hugging Face model directory (module docstring).

    Args:
      run_dir: an msjax run directory.
      out_dir: the directory to create (must not exist, or be empty).
      overrides: dotted keys applied to the run's config (the mesh to restore onto, e.g. {"mesh.data": 1}).
      dtype: float32 (exact) or bfloat16 for the written tensors.
      max_shard_bytes: the largest safetensors file.
      devices: the mesh's devices (default: all).
      config: the config to use instead of `<run_dir>/config.json` (+ overrides).
    Returns:
      ExportResult.
    Raises:
      HFConversionError: a model neither GPT-2 nor Llama can hold (naming the fields), a tokenizer with no HF
        form, an existing output directory.
      ConfigError, msjax.checkpoint.CheckpointError: as `msjax.runs.restore_params`.
    """
    from msjax.data import load_tokenizer
    from msjax.runs import restore_params, run_config

    t0 = time.perf_counter()
    if dtype not in ("float32", "bfloat16"):
        raise HFConversionError(f"--dtype={dtype!r}: allowed: 'float32', 'bfloat16'")
    run_dir, out_dir = local_path(run_dir, "--run_dir"), local_path(out_dir, "--out")
    cfg = run_config(run_dir, overrides) if config is None else apply_overrides(config, overrides or {}).validate()
    arch = architecture_for(cfg.model)
    tok_path = run_dir / "tokenizer.json"
    tokenizer = load_tokenizer(tok_path) if tok_path.is_file() else None
    program, step, params = restore_params(run_dir, cfg, devices)
    tmp = _fresh_target(out_dir, "--out")
    try:
        files = write_safetensors(hf_tensors(arch, program.config, params, dtype), tmp, max_shard_bytes)
        special = special_token_ids(tokenizer) if tokenizer is not None else {"bos": None, "eos": None, "pad": None}
        hf_config = hf_config_for(arch, program.config.model, special)
        hf_config["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        files.append("config.json")
        kept = run_dir / KEPT_DIR if (run_dir / KEPT_DIR).is_dir() else None
        if kept is not None and (kept / "generation_config.json").is_file():  # the imported model's own
            shutil.copyfile(kept / "generation_config.json", tmp / "generation_config.json")
        else:
            generation = {"bos_token_id": special["bos"], "eos_token_id": special["eos"]}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        if tokenizer is not None:
            write_tokenizer(tokenizer, tmp, kept, cfg.model.max_seq_len)
        files = sorted(p.name for p in tmp.iterdir())
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out_dir, arch, step, files, time.perf_counter() - t0)

