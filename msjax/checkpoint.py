"""Checkpoints through Orbax (a well-kept library that already does what MegaScale's two-stage design needs).

Orbax's asynchronous save is two-stage: the train state is copied device -> host memory while the step waits
(the short, blocking part), then a background thread writes it to TensorStore (zarr/OCDBT) files. A step's
directory is first written under a temporary name and renamed, with a commit marker, only when every process has
finished, so a checkpoint whose write did not finish is never listed and never restored.

Each checkpoint holds two items: `state` (the train state pytree, sharded arrays) and `loader` (the data
loader's JSON position), so `--resume` continues the same token stream.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from msjax.config import CheckpointConfig, ConfigError


def checkpoint_dir(cfg: CheckpointConfig, run_dir: str) -> Path:
    """The absolute checkpoint directory: `checkpoint.dir`, or `<run_dir>/checkpoints`."""
    return Path(cfg.dir or os.path.join(run_dir, "checkpoints")).expanduser().absolute()


def ensure_writable(path: Path, key: str = "checkpoint.dir") -> None:
    """Creates `path` and proves a file can be written there, before any training step runs.

    Raises:
      ConfigError: naming the config `key`, the directory and the OS error.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}={str(path)!r} is not writable ({e.strerror})") from None


class Checkpointer:
    """Saves every `cfg.every` steps (and on demand), keeps the last `cfg.keep`, restores the latest complete one.

    Args:
      cfg: checkpoint config.
      directory: where checkpoints live (see `checkpoint_dir`); must be writable (checked here).
    Raises:
      ConfigError: the directory is not writable.
    """

    def __init__(self, cfg: CheckpointConfig, directory: Path):
        ensure_writable(directory)
        self.cfg = cfg
        self.directory = directory
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                               create=True)
        self._manager = ocp.CheckpointManager(directory, options=options)

    def latest_step(self) -> int | None:
        """The newest step whose checkpoint finished writing, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, loader_state: dict, force: bool = False) -> bool:
        """Starts saving `state` and `loader_state` as `step`; returns whether a save was started.

        Without `force`, saves only on multiples of `cfg.every`. Returns after the device -> host copy; the write
        to storage continues in the background (`wait` blocks on it).
        """
        if not force and (self.cfg.every <= 0 or step % self.cfg.every):
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), loader=ocp.args.JsonSave(loader_state))
        return self._manager.save(step, args=args, force=True)

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict]:
        """Restores (step, state, loader_state) of `step` (default: the latest complete one) onto the shardings
        in `abstract_state` (a pytree of jax.ShapeDtypeStruct with `.sharding`, possibly another mesh).

        Raises:
          FileNotFoundError: there is no complete checkpoint in the directory.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), loader=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        return step, restored["state"], dict(restored["loader"])

    def wait(self) -> None:
        """Blocks until background writes have finished."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
