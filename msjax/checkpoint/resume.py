"""`--resume` safety: the saved config is compared with the current one before anything is touched.

A checkpoint fixes the shapes and structure of the state and the meaning of the token stream; keys that change
them must match. Keys that only change how the run goes on (more steps, another learning rate, another mesh:
Orbax restores onto any sharding) may differ.
"""

from __future__ import annotations

import json
from typing import Any

from msjax.config import Config, ConfigError, to_dict

# Keys (or prefixes ending in ".") that may differ between the saved and the resumed run.
MAY_DIFFER = (
    "name", "train.steps", "train.eval_every", "train.eval_batches", "train.log_every", "train.sample_tokens",
    "train.sample_temperature", "train.progress", "train.run_dir", "train.nonfinite", "train.seed",
    "optimizer.lr", "optimizer.min_lr", "optimizer.warmup_steps", "optimizer.decay_steps", "optimizer.b1",
    "optimizer.b2", "optimizer.eps", "optimizer.weight_decay", "optimizer.grad_clip", "checkpoint.", "mesh.",
    "data.prefetch", "data.cache_dir", "model.remat", "model.attention.impl", "model.dtype",
    # gradient accumulation splits the same global batch (the supervisor's re-planning changes it with the mesh);
    # how a run is supervised does not touch its state
    "train.microbatches", "supervisor.",
    # where object storage is reached (an endpoint, a region) is not what is stored there
    "storage.",
    # where the metrics go
    "train.loggers",
    # how many steps one call of the compiled program runs: the same steps on the same batches
    "train.steps_per_execution",
)


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _may_differ(key: str) -> bool:
    return any(key == m or (m.endswith(".") and key.startswith(m)) for m in MAY_DIFFER)


def config_differences(saved: dict, current: Config) -> list[str]:
    """Keys that differ between a saved config (as `to_dict` wrote it) and `current` but must not, sorted,
    each as "key: saved -> current".

    `model.vocab_size` 0 in the current config means "take the tokenizer's" and is not compared.
    `optimizer.grad_clip` may change its value but not switch clipping on or off (that changes the optimizer
    state's structure).
    """
    now = _flat(json.loads(json.dumps(to_dict(current))))  # tuples -> lists, as in the saved JSON
    # A key the saved config lacks (added to msjax after that run was saved) had its default then.
    defaults = _flat(json.loads(json.dumps(to_dict(Config()))))
    old = {**{k: v for k, v in defaults.items() if k in now}, **_flat(saved)}
    diffs = []
    for key in sorted(set(now) | set(old)):
        a, b = old.get(key, "<absent>"), now.get(key, "<absent>")
        if a == b:
            continue
        if key == "model.vocab_size" and b == 0:
            continue
        if key == "optimizer.grad_clip" and isinstance(a, (int, float)) and (a > 0) == (b > 0):
            continue
        if key != "optimizer.grad_clip" and _may_differ(key):
            continue
        diffs.append(f"{key}: {a!r} -> {b!r}")
    return diffs


def check_resume_config(saved: dict | None, current: Config, where: str) -> None:
    """Raises ConfigError listing every key that must match but differs; does nothing when `saved` is None.

    Args:
      saved: the config stored with the newest checkpoint (or the run's config.json), as a nested dict.
      current: the config of the run that wants to resume.
      where: where `saved` came from (named in the error).
    Raises:
      ConfigError: one message listing the differing keys and the keys that may differ.
    """
    if saved is None:
        return
    diffs = config_differences(saved, current)
    if diffs:
        allowed = ", ".join(m + ("*" if m.endswith(".") else "") for m in MAY_DIFFER)
        raise ConfigError(
            f"--resume: the config differs from the one saved with the checkpoint ({where}) in keys that fix the "
            f"model, optimizer state or data stream: {'; '.join(diffs)}. Nothing was changed. Keys that may "
            f"differ on resume: {allowed} (optimizer.grad_clip only between values > 0). Start a new run (another "
            "train.run_dir) to change the others.")
