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
# What may also differ when the checkpoint is of step 0 (an imported model, `convert.py --from_hf`): no batch has
# been drawn from its data stream yet, so another corpus, format or batch shape starts that stream afresh (the
# loader's state at step 0 is its seed alone). Fine-tuning an imported model on one's own data is this case.
UNTRAINED_MAY_DIFFER = ("data.", "train.global_batch", "train.seq_len")


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _may_differ(key: str, untrained: bool = False) -> bool:
    allowed = MAY_DIFFER + (UNTRAINED_MAY_DIFFER if untrained else ())
    return any(key == m or (m.endswith(".") and key.startswith(m)) for m in allowed)


def config_differences(saved: dict, current: Config, step: int | None = None) -> list[str]:
    """Keys that differ between a saved config (as `to_dict` wrote it) and `current` but must not, sorted,
    each as "key: saved -> current". `step`: the checkpoint's; at 0 the data keys may differ too
    (`UNTRAINED_MAY_DIFFER`).

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
        if key != "optimizer.grad_clip" and _may_differ(key, untrained=step == 0):
            continue
        diffs.append(f"{key}: {a!r} -> {b!r}")
    return diffs


def check_resume_config(saved: dict | None, current: Config, where: str, step: int | None = None) -> None:
    """Raises ConfigError listing every key that must match but differs; does nothing when `saved` is None.

    Args:
      saved: the config stored with the newest checkpoint (or the run's config.json), as a nested dict.
      current: the config of the run that wants to resume.
      where: where `saved` came from (named in the error).
      step: the checkpoint's step (0: untrained, its data keys may differ), or None.
    Raises:
      ConfigError: one message listing the differing keys and the keys that may differ.
    """
    if saved is None:
        return
    diffs = config_differences(saved, current, step)
    if diffs:
        allowed = ", ".join(m + ("*" if m.endswith(".") else "") for m in MAY_DIFFER)
        raise ConfigError(
            f"--resume: the config differs from the one saved with the checkpoint ({where}) in keys that fix the "
            f"model, optimizer state or data stream: {'; '.join(diffs)}. Nothing was changed. Keys that may "
            f"differ on resume: {allowed} (optimizer.grad_clip only between values > 0). Start a new run (another "
            "train.run_dir) to change the others.")
