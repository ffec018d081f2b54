"""The one home of the private jax and Orbax names msjax uses, each checked against the versions it was read in.

msjax reaches past a library's public API only where that API has no way to do what a run needs; every such name
is listed in `PRIVATE` with the reason, and nothing else in msjax imports `jax._src` or `orbax.checkpoint._src`
(tests/test_private_names.py checks both, and that every listed name resolves on the installed versions):

  jax_distributed         jax's coordination-service client (`global_state.client`): a barrier and a key-value
                          store between processes outside of collectives; jax exports neither.
  jax_xla_bridge          whether a backend has started (`backends_are_initialized`): after that XLA_FLAGS is
                          read no more, and jax has no public query.
  jax_compiler,           the persistent compilation cache's writer (`_cache_write`) and jax's own entry writer
  jax_compilation_cache   (`put_executable_and_time`): `cache_every_process` lets every process of a CPU job write
                          its own entries (`msjax.runtime.cache_on_every_process` says why).
  orbax_future,           Orbax's signalling threads and operation ids: after a failed asynchronous save,
  orbax_synchronization   msjax.checkpoint ends the threads Orbax leaves waiting (no public call does).
  orbax_multislice        Orbax's replica helpers (restore on one replica, broadcast to the others), not exported.

Version guard: each name was read in the versions of `VERIFIED`. `private(key)` imports the module and checks
that every attribute msjax reads is there; a missing one raises `PrivateAPIError` naming the name, the installed
version and the versions it was read in, at the first use, not as a wrong result later. Outside the verified
versions a name that is still present is used, and a warning says the version was not the one read.
Reach a module as an attribute (`from msjax.compat import jax_distributed`): it is imported and checked on first
use, so a module that never uses Orbax's names never imports Orbax through this one.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import re
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

# The releases each package's private names were read in: [first, end) as (major, minor, patch) tuples.
# pyproject.toml admits the same ranges.
VERIFIED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "jax": ((0, 10, 2), (0, 12)),
    "orbax-checkpoint": ((0, 12, 8), (0, 13)),
}


@dataclass(frozen=True)
class PrivateName:
    """A private module of `package` and the attributes of it that msjax reads (dotted for an attribute of an
    object the module holds, such as `global_state.client`)."""

    package: str
    module: str
    attrs: tuple[str, ...]


PRIVATE: dict[str, PrivateName] = {
    "jax_distributed": PrivateName("jax", "jax._src.distributed",
                                   ("global_state", "global_state.client", "global_state.process_id")),
    "jax_xla_bridge": PrivateName("jax", "jax._src.xla_bridge", ("backends_are_initialized",)),
    "jax_compiler": PrivateName("jax", "jax._src.compiler", ("_cache_write",)),
    "jax_compilation_cache": PrivateName("jax", "jax._src.compilation_cache", ("put_executable_and_time",)),
    "orbax_future": PrivateName("orbax-checkpoint", "orbax.checkpoint._src.futures.future",
                                ("_SignalingThread", "_SignalingThread.cancel", "set_signals")),
    "orbax_synchronization": PrivateName("orbax-checkpoint", "orbax.checkpoint._src.futures.synchronization",
                                         ("OperationIdGenerator.get_current_operation_id",)),
    "orbax_multislice": PrivateName("orbax-checkpoint", "orbax.checkpoint._src.multihost.multislice",
                                    ("process_spans_multiple_replicas", "replica_devices",
                                     "get_leaf_memory_per_device", "broadcast_one_replica_to_all")),
}

# jax._src.compiler._cache_write's parameters, as read in the verified versions; the wrapper relies on them.
CACHE_WRITE_PARAMETERS = ("cache_key", "compile_time_secs", "module_name", "backend", "executable",
                          "host_callbacks")


class PrivateAPIError(ImportError):
    """A private name msjax relies on is not where it was read: the installed jax or Orbax moved it."""


def version(package: str) -> tuple[int, ...]:
    """The installed release of `package` as a tuple of its leading integers ("0.10.2" -> (0, 10, 2))."""
    text = importlib.metadata.version(package)
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def verified(package: str) -> bool:
    """Whether the installed `package` is a release its private names were read in (`VERIFIED`)."""
    first, end = VERIFIED[package]
    return first <= version(package) < end


def _range(package: str) -> str:
    first, end = VERIFIED[package]
    return f">={'.'.join(map(str, first))},<{'.'.join(map(str, end))}"


def resolve(name: PrivateName, key: str = "") -> ModuleType:
    """Imports `name.module` and checks every attribute in `name.attrs`.

    Raises:
      PrivateAPIError: the module or one of the attributes is missing (names it, the installed version and the
        versions it was read in).
    """
    where = f"{key + ': ' if key else ''}{name.module}"
    installed = importlib.metadata.version(name.package)
    read_in = f"read in {name.package}{_range(name.package)}, installed {installed}"
    try:
        module = importlib.import_module(name.module)
    except ImportError as e:
        raise PrivateAPIError(f"msjax.compat: {where} cannot be imported ({e}); {read_in}") from None
    for dotted in name.attrs:
        obj: Any = module
        for part in dotted.split("."):
            if not hasattr(obj, part):
                raise PrivateAPIError(f"msjax.compat: {where}.{dotted} is gone; {read_in}")
            obj = getattr(obj, part)
    return module


_resolved: dict[str, ModuleType] = {}


def private(key: str) -> ModuleType:
    """The private module `PRIVATE[key]`, checked (see `resolve`) once per process.

    Raises:
      KeyError: `key` is not in PRIVATE (names the keys allowed).
      PrivateAPIError: the installed version moved one of its names.
    """
    if key not in _resolved:
        if key not in PRIVATE:
            raise KeyError(f"msjax.compat: no private name {key!r}; allowed: {', '.join(sorted(PRIVATE))}")
        name = PRIVATE[key]
        module = resolve(name, key)
        if not verified(name.package):
            warnings.warn(f"msjax.compat: {name.module} is used with {name.package} "
                          f"{importlib.metadata.version(name.package)}; its names were read in "
                          f"{name.package}{_range(name.package)} (they are present, so it goes on)", stacklevel=2)
        _resolved[key] = module
    return _resolved[key]


def __getattr__(key: str) -> ModuleType:
    # `from msjax.compat import jax_distributed`: the private module, imported and checked on first use.
    if key in PRIVATE:
        return private(key)
    raise AttributeError(f"module 'msjax.compat' has no attribute {key!r}")


def distributed_client() -> Any | None:
    """jax's coordination-service client (`wait_at_barrier`, `key_value_set_bytes`, ...), or None before
    `jax.distributed.initialize`."""
    return private("jax_distributed").global_state.client


def backends_are_initialized() -> bool:
    """Whether jax has started a backend (after which XLA reads XLA_FLAGS no more)."""
    return bool(private("jax_xla_bridge").backends_are_initialized())


def cache_every_process() -> bool:
    """Wraps jax's persistent-cache writer so that a process other than 0 of a CPU job writes its own entries,
    with jax's own writer and jax's own conditions (no host callbacks; at least
    `jax_persistent_cache_min_compile_time_secs` of compiling); other processes and platforms keep jax's
    behaviour. Why: `msjax.runtime.cache_on_every_process`.

    Returns whether the wrapper is in place: False when the writer's parameters are not the ones read
    (`CACHE_WRITE_PARAMETERS`), in which case nothing is changed.
    Raises:
      PrivateAPIError: the writer or jax's entry writer is gone.
    """
    import jax

    compiler, compilation_cache = private("jax_compiler"), private("jax_compilation_cache")
    distributed = private("jax_distributed")
    original = compiler._cache_write
    if getattr(original, "__wrapped__", None) is not None:  # ours already
        return True
    if tuple(inspect.signature(original).parameters) != CACHE_WRITE_PARAMETERS:
        return False

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if distributed.global_state.process_id in (None, 0) or getattr(backend, "platform", "") != "cpu":
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        if host_callbacks or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return None
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as ex:  # noqa: BLE001 - jax's own policy: a failed cache write warns, the run goes on
            if jax.config.jax_raise_persistent_cache_errors:
                raise
            warnings.warn(f"msjax: error writing persistent compilation cache entry for {module_name!r}: "
                          f"{type(ex).__name__}: {ex}")
        return None

    cache_write.__wrapped__ = original  # type: ignore[attr-defined]
    compiler._cache_write = cache_write
    return True
