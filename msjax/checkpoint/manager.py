"""The Checkpointer: verified two-stage checkpoints in two tiers, through Orbax.

Stages (MegaScale sec. 4.3; Orbax's asynchronous save is the library that does stage 1 and 2):
  1. `save` returns after Orbax has copied the device state to host memory: the only part the loop waits for.
     The integrity checksums (msjax.checkpoint.integrity) are dispatched on the devices in the same call and
     read only when the write has finished.
  2. Orbax's background thread writes the host copy to TensorStore (zarr/OCDBT) under a temporary name and
     renames it when every process is done (its commit).
  3. When `poll` (called by the loop each step, without touching the device) sees the write finished, the
     integrity record is written into the step directory; only then is the checkpoint complete. A one-thread
     worker then copies it from the local tier to the persistent tier (temporary name, then rename) and rotates
     both tiers. A failed write or copy raises `CheckpointWriteError` at the next `poll`: promptly, with the
     path and the OS error.

Restore with `checkpoint.replica_restore` (default) and a mesh with data > 1 over which the state is replicated:
the processes of data-parallel replica 0 read, and Orbax's broadcast gives every replica its copy, bit for bit
(msjax.checkpoint.replica).

Tiers (msjax.checkpoint.tiers): with `checkpoint.local_dir` set, each process writes its own part of every step
to its own directory `<local_dir>/process-<i>` (host RAM such as /dev/shm, or a local disk; a path that may exist
separately on every host), uploads its part to the persistent tier (`checkpoint.dir`), and process 0 writes the
persistent record once every process's part is durable (msjax.checkpoint.shards says which files are whose). The
local tier keeps `local_keep` checkpoints and the persistent tier the last `keep`. A persistent tier on object
storage (`gs://`, `s3://`) without `checkpoint.local_dir` gets a staging directory in the user's cache as its local
tier, since Orbax writes only local directories (msjax.paths says why). Without a local tier, Orbax's multi-host
writer writes straight into a local persistent directory, which every process must then share. With
`checkpoint.local_replicas` each process's local part is also copied to the next processes' hosts (peer replicas,
msjax.checkpoint.peers); with `checkpoint.persistent_every` only every so many steps go on to the persistent tier.

A restore reads, on each process, its own local copy when it holds every chunk its shards touch; else, with peer
replicas, the copies on the job's hosts when they hold every part of the step (only the chunks it reads); else the
persistent tier: a local one in place (only the chunks it reads), an object store by downloading only the files
this process reads (none of the arrays outside a single-replica restore's source replica). The restored state is
verified against the record either way.

Verified means one thing: a checkpoint's integrity record is durable (fsynced in a local tier, its object written
in an object store), and the record is written only after everything it describes. `latest_verified(dir,
local_dir)` names the newest such step; `restore` tries exactly that one first, and goes back further only when
its content fails verification (checksum mismatch, missing or unreadable file), reported in one warning line.
Rotation only deletes checkpoints older than the newest `keep` recorded ones, so it never deletes the newest
verified one.

When to save is Orbax's decision (`save_interval_steps` = `checkpoint.every`, and its preemption check through
jax's preemption sync point); `force` is only for saves the loop was asked for (the last step, a stop, a
control-plane request).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import os
import shutil
import threading
import time
import uuid
import hashlib
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocp_policies

from msjax import paths
from msjax.compat import orbax_future as ocp_future
from msjax.compat import orbax_synchronization as ocp_sync
from msjax.checkpoint import peers, replica, shards
from msjax.checkpoint.integrity import (RECORD_NAME, checksum_programs, checksum_state, combine_partials, mismatches,
                                       read_record, write_record)
from msjax.checkpoint.tiers import LocalTier, ObjectTier, make_tier
from msjax.config import CheckpointConfig, ConfigError
from msjax.runtime import cache_home


_instances = itertools.count()  # Checkpointers made in this process: the same sequence on every process

class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none could be restored; the message names the path and reason."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint write or copy failed (e.g. a read-only or full disk). The previous checkpoints are kept."""


class NonFiniteStateError(CheckpointError):
    """The state to be saved holds NaN or Inf; it was not made a checkpoint."""


class NoWholeCheckpointError(CheckpointError):
    """Every checkpoint the job holds survives on some hosts only: their other parts were lost with their hosts
    (node-local tiers), and neither the persistent tier nor a peer replica holds them. None is damaged; there is
    nothing whole to resume from (the caller may start afresh; `restore` deleted those parts)."""


_SOME_HOSTS_ONLY = "in the local tier of some processes only"


def checkpoint_dir(cfg: CheckpointConfig, run_dir: str) -> Path | str:
    """The persistent tier: `checkpoint.dir`, or `<run_dir>/checkpoints`; an absolute local `Path`, or a `gs://` /
    `s3://` URL (a str).

    Raises:
      msjax.paths.PathError: an unsupported scheme, or one whose package is missing (names the extra).
    """
    if cfg.dir:
        where = paths.check(cfg.dir, "checkpoint.dir")
        return where if paths.is_remote(where) else Path(where)
    return Path(paths.check(os.path.join(run_dir, "checkpoints"), "train.run_dir"))


def local_checkpoint_dir(cfg: CheckpointConfig) -> Path | None:
    """The absolute local-tier directory, or None when there is no local tier.

    Raises:
      msjax.paths.PathError: `checkpoint.local_dir` is a URL.
    """
    return paths.local(cfg.local_dir, "checkpoint.local_dir") if cfg.local_dir else None


def staging_dir(directory: str) -> Path:
    """The local tier of an object-storage persistent tier `directory` without `checkpoint.local_dir`: a folder in
    the user's cache named by a hash of the URL and the endpoint that serves it (the same bucket name on two
    stores is two directories), so a restarted run on the same host finds what it wrote."""
    endpoint = paths.endpoint(directory)
    key = f"{directory} at {endpoint}" if endpoint else directory  # default endpoints: the URL alone, as before
    return cache_home() / "checkpoint-staging" / hashlib.sha256(key.encode()).hexdigest()[:16]


def ensure_writable(path: Path | str, key: str = "checkpoint.dir") -> None:
    """Creates `path` and proves a file (or object) can be written there, before any training step runs.

    Raises:
      ConfigError: naming the config key, the directory and the error (OS error, or the object store's).
    """
    if paths.is_remote(path):
        probe = paths.join(path, f".write-probe-{uuid.uuid4().hex}")
        try:
            with paths.storage_logs_quiet():  # the error below is the report: not the retries' tracebacks too
                paths.write_bytes(probe, b"ok")
                paths.remove(probe)
        except Exception as e:  # noqa: BLE001 - any backend error (no bucket, refused, denied) is the report
            raise ConfigError(f"{key}={str(path)!r} is not writable ({type(e).__name__}: {e})") from None
        return
    try:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}={str(path)!r} is not writable ({e.strerror})") from None


def host_dir(local_directory: Path | str) -> Path:
    """This process's part of the local tier, `<local_directory>/process-<i>`: each process writes its own shards
    there, so the local tier may be a path that exists separately on every host (or one directory they share)."""
    return Path(local_directory) / f"process-{jax.process_index()}"


def _tiers(directory: Path | str, local_directory: Path | None) -> list[LocalTier | ObjectTier]:
    """The tiers a checkpoint of this persistent `directory` may be in, local first (this process's part of it)."""
    if local_directory is None and paths.is_remote(directory):
        local_directory = staging_dir(os.fspath(directory))
    local = [LocalTier("local", host_dir(local_directory))] if local_directory is not None else []
    return local + [make_tier("persistent", directory)]


# A partial restore reads its arrays in this many groups of about equal bytes (Checkpointer._read_in_groups).
PARTIAL_READ_GROUPS = 32


def _path_key(entry: Any) -> Any:
    """The dict key of one entry of a jax key path; a partial restore's state is nested dicts (its parameters)."""
    if not isinstance(entry, jax.tree_util.DictKey):
        raise TypeError(f"a partial restore takes nested dicts of arrays; found the key path entry {entry!r}")
    return entry.key


def _candidates(tiers: list[LocalTier | ObjectTier]) -> list[tuple[int, LocalTier | ObjectTier]]:
    """Every committed step of the tiers as (step, tier), newest first, the local tier first at equal steps (it
    restores faster). Includes steps without an integrity record."""
    out = [(s, i, tier) for i, tier in enumerate(tiers) for s in tier.steps()]
    return [(s, tier) for s, _, tier in sorted(out, key=lambda c: (-c[0], c[1]))]


def _recorded(tier: LocalTier | ObjectTier, step: int) -> dict | None:
    """The step's record, or None when it has none or an unreadable one."""
    try:
        return tier.record(step)
    except ValueError:
        return None


def latest_verified(directory: Path | str, local_directory: Path | str | None = None) -> int | None:
    """The newest verified checkpoint's step in either tier, or None: the step `Checkpointer.restore` resumes
    from, unless that checkpoint's content fails its checksums (then it goes back further and says so).

    Verified means its integrity record is durable: fsynced in a local tier, its object written in an object
    store; the record is written only after everything it describes, so a step whose write or copy was cut short
    at any point has none. The one definition for the restore and for any reader (a supervisor).

    Args:
      directory: the persistent tier (`checkpoint_dir(cfg.checkpoint, run_dir)`): a local path or a URL.
      local_directory: the local tier (`local_checkpoint_dir(cfg.checkpoint)`), or None.
    """
    local = None if local_directory is None else Path(local_directory)
    for step, tier in _candidates(_tiers(directory, local)):
        if _recorded(tier, step) is not None:
            return step
    return None


def _warn(msg: str) -> None:
    if jax.process_index() == 0:
        logging.getLogger(__name__).warning(msg)


def _os_error(e: BaseException) -> BaseException:
    """The OSError at the root of an exception chain (Orbax wraps them), else `e`."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return e


def _rotate(tier: LocalTier | ObjectTier, keep: int) -> None:
    """Deletes the checkpoints of `tier` older than its newest `keep` recorded ones (record first). Steps without
    a record that are newer than those may be a write in flight and are left alone; so are damaged ones newer
    than them: rotation never deletes the newest verified checkpoint, whatever else the tier holds."""
    steps = tier.steps()
    recorded = [s for s in steps if _recorded(tier, s) is not None]
    if len(recorded) <= keep:
        return
    oldest_kept = recorded[keep - 1]
    for s in steps:
        if s < oldest_kept:
            tier.delete(s)


_barriers = itertools.count()  # coordination barriers of this process: names unique within a jax.distributed session


def _meet(what: str, timeout_s: float) -> None:
    """Waits (at most `timeout_s`) until every process of a multi-process run arrives here, at a coordination
    service barrier rather than in a collective: CPU collectives give up on a peer that is late by more than their
    own short timeout, and process 0 may be downloading or moving a checkpoint for minutes meanwhile."""
    if jax.process_count() == 1:
        return
    from msjax.compat import jax_distributed  # jax has no public barrier outside collectives

    jax_distributed.global_state.client.wait_at_barrier(f"msjax_checkpoint_{next(_barriers)}_{what}",
                                                        int(timeout_s * 1000))


def _any_process(flag: bool) -> bool:
    """True when `flag` is true on any process: one small all-gather in a multi-process run (every process must
    call it at the same point), `flag` itself otherwise."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def _wait(what: str, fn: Callable[[], Any], timeout_s: float) -> None:
    """Runs `fn` (a blocking wait on Orbax's threads, which has no timeout of its own) in a daemon thread and
    waits at most `timeout_s` for it; re-raises its exception.

    Raises:
      CheckpointWriteError: it took longer than `timeout_s` (names `what`).
    """
    box: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append(e)

    t = threading.Thread(target=target, name="msjax-checkpoint-wait", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise CheckpointWriteError(f"gave up after {timeout_s:.0f} s waiting for {what} "
                                   "(checkpoint.timeout_s)")
    if box:
        raise box[0]


def _release_abandoned_save(operation_id: str, timeout_s: float = 10.0) -> list[str]:
    """Ends the Orbax threads of a failed asynchronous save, so that they do not outlive the run.

    Why they would: Orbax runs each commit step of a save (writing the array data, the shardings, the JSON item,
    the metadata) in a non-daemon `_SignalingThread` (orbax/checkpoint/_src/futures/future.py) that first waits
    for the STEP_DIRECTORY_CREATION signal of its save (`wait_for_signals` -> `blocking_key_value_get`, with
    Orbax's coordination timeout, 300 s). When creating the step directory fails (a read-only or full disk),
    that signal is never sent; Orbax's background `async_save` thread reports the error, but the waiting threads
    stay blocked for the full 300 s, and the interpreter waits for them at exit (measured: five such threads,
    `json_ch_save`, `serialize_shardings`, `array_type_handler`, `write_metadata_after_commits` and one unnamed).
    `CheckpointManager.close()` and `AsyncCheckpointer.cancel()` do not reach them once the error was raised
    (`_AsyncManager.wait_until_finished` has dropped its thread, so `cancel` returns at once), and a `cancel()` on
    the future only sets a flag that the thread reads after its wait.

    So, for every such thread of the failed save's operation: mark it cancelled (Orbax's own `cancel`) and send
    the signals it waits for (Orbax's own `set_signals`, the same key-value store it reads); it wakes, sees
    the cancellation and returns without writing anything. Orbax has no public call for this; the private names
    used are `_SignalingThread`, `_receive_signals` and `_operation_id` (orbax-checkpoint 0.12.8).

    Returns:
      The names of the threads that were still alive after `timeout_s` seconds (empty when all ended).
    """
    threads = [t for t in threading.enumerate()
               if isinstance(t, ocp_future._SignalingThread) and t.is_alive()
               and getattr(t, "_operation_id", None) == operation_id]
    for t in threads:
        t.cancel()
        ocp_future.set_signals(t._receive_signals, operation_id=operation_id)
    deadline = time.monotonic() + timeout_s
    for t in threads:
        threading.Thread.join(t, max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]


def _per_host_handlers(tag: str) -> tuple[ocp.options.MultiprocessingOptions, dict]:
    """Orbax's options and item handlers for a process that writes its own part of every step into a directory of
    its own (msjax.checkpoint.shards): this process is the primary of that directory and the only process its
    barriers wait for; arrays in zarr without OCDBT, every addressable shard written (replicas included), one
    writer per shard (no replica-parallel split). Orbax's emergency checkpointer configures its local tier so."""
    multiprocessing = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={jax.process_index()},
                                                         barrier_sync_key_prefix=tag)
    th = ocp.type_handlers
    # Orbax's default handlers (its _DEFAULT_TYPE_HANDLERS, which it does not export), jax.Array's replaced.
    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()), (float, th.ScalarHandler()), (bytes, th.ScalarHandler()),
        (np.number, th.ScalarHandler()), (np.ndarray, th.NumpyHandler()), (str, th.StringHandler()),
        (jax.Array, th.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
    return multiprocessing, {
        shards.STATE_ITEM: ocp.PyTreeCheckpointHandler(use_ocdbt=False, multiprocessing_options=multiprocessing,
                                                       type_handler_registry=registry),
        "loader": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing)}


_REPLICA_NOTES_LOGGED: set[str] = set()  # reasons already logged by Checkpointer.restore


class Checkpointer:
    """Saves, verifies, rotates and restores checkpoints of (train state, data loader position).

    Opening one deletes the interrupted writes (committed steps without an integrity record) of both tiers, so a
    restarted run can write those steps again; verified steps are never deleted there. A reader of another run's
    checkpoints (generation, export) opens one with `read_only=True`: a step of a live run may sit between Orbax's
    commit and its record, so a reader passes over what does not verify and deletes or moves nothing.

    Args:
      cfg: checkpoint config (`every`, `keep`, `local_dir`, `local_keep`, `async_save`, `timeout_s`,
        `replica_restore`).
      directory: the persistent tier (see `checkpoint_dir`): a local directory, or a gs:// / s3:// URL.
      local_directory: the local tier, or None (default: from `cfg.local_dir`; with an object-storage
        `directory` and no local tier, `staging_dir(directory)`).
      read_only: restore only: no deletion, no moving aside, no leftovers cleaned, no writability check.
    Raises:
      ConfigError: a tier directory is not writable (or a bucket not reachable).
    """

    def __init__(self, cfg: CheckpointConfig, directory: Path | str, local_directory: Path | None = None,
                 read_only: bool = False):
        local_directory = local_directory or local_checkpoint_dir(cfg)
        self._instance = next(_instances)
        self._tier_list = _tiers(directory, local_directory)
        self.persistent = self._tier_list[-1]
        self.local = self._tier_list[0] if len(self._tier_list) > 1 else None
        self.read_only = read_only
        if not read_only:
            ensure_writable(directory)
        if self.local is not None and not read_only:
            ensure_writable(self.local.root, "checkpoint.local_dir" if local_directory else "staging directory")
        self.cfg = cfg
        self.directory = directory
        self.local_directory = self.local.root if self.local is not None else None
        self.write_directory: Path = self.local_directory or Path(directory)
        # What the first restore reports as passed over, "<path>: <reason>" (see `skipped`).
        self._interrupted = [] if read_only else self._discard_interrupted(cfg.timeout_s)
        # Orbax decides when to save: every `every` steps, and when jax's preemption sync point is reached.
        # Its InitialSavePolicy (save the first step of a run) is left out: the first step is not worth a write.
        policies = [ocp_policies.PreemptionCheckpointingPolicy()]
        if cfg.every > 0:
            policies.insert(0, ocp_policies.FixedIntervalPolicy(cfg.every))
        # With a local tier every process writes its own part of each step into its own directory (per host:
        # msjax.checkpoint.shards); without one, Orbax's multi-host writer writes one checkpoint into the
        # persistent directory, which every process must then share.
        self.per_host = self.local is not None
        if self.per_host:  # Orbax's `create` would make it on process 0 only (and not at all with active_processes)
            self.local.root.mkdir(parents=True, exist_ok=True)
        multiprocessing, handlers = (_per_host_handlers(self._instance_tag()) if self.per_host
                                     else (ocp.options.MultiprocessingOptions(), {}))
        # Per host, Orbax creates the step's directories inside `save` rather than on a thread: its threads wait for
        # a "directories created" signal whose key holds Orbax's operation id but not the process, and the
        # operation ids run in step on every process, so one host's signal would release another host's threads
        # into directories that do not exist yet (seen: FileNotFoundError under `<step>.orbax-checkpoint-tmp`).
        async_options = ocp.AsyncOptions(create_directories_asynchronously=False) if self.per_host else None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # rotation is ours: it must count only complete (recorded) checkpoints
            enable_async_checkpointing=cfg.async_save, create=not self.per_host, cleanup_tmp_directories=True,
            save_decision_policy=ocp_policies.AnySavePolicy(policies), multiprocessing_options=multiprocessing,
            async_options=async_options)
        self._manager = ocp.CheckpointManager(self.write_directory, options=options, **(
            {"item_handlers": handlers} if handlers else {}))
        if not read_only:  # copies into a tier cut short by a crash: each process its own local part
            for tier in self._tier_list:
                if jax.process_index() == 0 or tier is self.local:
                    tier.remove_leftovers()
            _meet("open_leftovers_removed", cfg.timeout_s)
        self._reader = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers),
                                        multiprocessing_options=multiprocessing)
        # Peer replicas (msjax.checkpoint.peers): the processes whose local parts this one keeps a copy of, and the
        # server through which the others read this host's local tier. None: no peer replicas.
        self._replica_sources: list[int] | None = None
        self._server: peers.PeerServer | None = None
        self._servers: dict[int, tuple[str, str]] = {}
        self._restores = 0
        self._peer_set: peers.PeerSet | None = None  # the last restore's view of the job's local tiers
        if self.per_host and cfg.local_replicas > 0 and jax.process_count() > 1 and not read_only:
            self._start_peer_server()
        # The step whose write is in flight, the fetch of its checksums, the rest of its record, Orbax's operation
        # id of the save (to end its threads if it fails), this process's shards (per host) and whether the step
        # goes on to the persistent tier.
        self._pending: tuple[int, Callable[[], tuple[dict, bool]], dict, str, list | None, bool] | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="msjax-checkpoint")
        self._compile_thread: threading.Thread | None = None  # `prepare`'s
        self._worker_jobs: list[tuple[int, concurrent.futures.Future]] = []
        # Held by the worker while it rotates (deletes step directories) and by the loop while Orbax re-lists the
        # steps: a listing that stats a directory the worker is deleting fails with FileNotFoundError.
        self._rotation = threading.Lock()
        self.replica_restore = False  # whether the last restore read one replica and broadcast
        self.skipped: list[str] = []  # what the last restore passed over, "<path>: <reason>", newest first
        self.last_save_timing: dict[str, float] = {}
        self.last_restore_timing: dict[str, float] = {}
        # What this process uploaded of the last step it completed (per-host tiers): step, chunk files, files, bytes.
        self.last_upload: dict[str, int] = {}
        # What the last restore downloaded from object storage on this process: chunk files (None: a checkpoint
        # in the OCDBT layout, downloaded whole), bytes, seconds.
        self.last_download: dict[str, Any] = {"chunks": 0, "bytes": 0, "seconds": 0.0}
        # What this process copied from its peers' local parts at the last save it completed: step, bytes, seconds.
        self.last_replica: dict[str, float] = {}
        self.verified_step: int | None = None  # the newest step known complete (written, or restored + verified)
        self._closed = False

    def _start_peer_server(self) -> None:
        from msjax.compat import jax_distributed

        pid = jax.process_index()
        self._replica_sources = peers.sources(pid, jax.process_count(), self.cfg.local_replicas)
        for w in self._replica_sources:  # copies from other processes cut short by a crash
            self._replica_tier(w).remove_leftovers()
        host = peers.route_address(jax_distributed.global_state.coordinator_address)
        self._server = peers.PeerServer(self.local.root.parent, host, self.cfg.timeout_s)
        self._kv_set(self._kv_key("peers", f"server-{pid}"),
                     json.dumps([self._server.address, self._server.token]).encode())

    def _replica_tier(self, writer: int) -> LocalTier:
        """This host's copies of process `writer`'s local parts (peer replicas)."""
        return LocalTier("replica", self.local.root.parent / peers.replica_dir(writer))

    def _peer_servers(self) -> dict[int, tuple[str, str]]:
        """{process: (address, token)} of every process's peer server, waited for at most checkpoint.timeout_s."""
        if not self._servers:
            for p in range(jax.process_count()):
                said = self._kv_get(self._kv_key("peers", f"server-{p}"), f"process {p}'s peer server")
                self._servers[p] = tuple(json.loads(said))
        return self._servers

    def _instance_tag(self) -> str:
        return f"msjax-ckpt{self._instance}-p{jax.process_index()}"

    def _discard_interrupted(self, timeout_s: float) -> list[str]:
        """Deletes every committed step without an integrity record (a write cut short, e.g. by kill -9 between
        Orbax's commit and the record) from both tiers, before Orbax lists the steps: left in place, such a step
        makes Orbax refuse a later save of the same step (StepAlreadyExistsError), so a restarted run that has no
        verified checkpoint yet, or resumes from an older one, would crash when it reaches that step again. A step
        with a record, readable or not, is never deleted here (a damaged one is moved aside by `restore`).

        Every process lists before any deletion and waits for process 0's deletions, so all of them report the
        same steps and Orbax's manager lists the same steps on each. Returns "<path>: interrupted write" for each.
        """
        found = []
        for tier in self._tier_list:
            for step in tier.steps():
                try:
                    recorded = tier.record(step) is not None
                except ValueError:
                    recorded = True  # unreadable, not absent: the restore reports it and moves it aside
                if not recorded:
                    found.append((tier, step))
        _meet("open_listed", timeout_s)
        for tier, step in found:
            _warn(f"checkpoint {tier.path(step)} has no integrity record (its write was interrupted); deleted")
            if jax.process_index() == 0 or tier is self.local:  # the local tier: each process its own part
                tier.delete(step)
        _meet("open_discarded", timeout_s)
        return [f"{tier.path(step)}: interrupted write" for tier, step in found]

    # ---- listing ----------------------------------------------------------------------------------------------

    def candidates(self) -> list[tuple[int, str, str]]:
        """Every committed step of both tiers as (step, tier name, path or URL), newest first, local first at
        equal steps (it restores faster). Includes steps without an integrity record."""
        return [(s, tier.name, tier.path(s)) for s, tier in _candidates(self._tier_list)]

    def latest_step(self) -> int | None:
        """`latest_verified` of this checkpointer's tiers: the step `restore` tries first."""
        for step, tier in _candidates(self._tier_list):
            if _recorded(tier, step) is not None:
                return step
        return None

    def job_latest_step(self) -> int | None:
        """The newest `latest_step` of any process of the job: where local tiers are each host's own, a process on a
        new host (an empty tier) sees none of its own, yet resumes with the others, from their copies (peer
        replicas) or the persistent tier. Collective in a multi-process run: every process calls it."""
        mine = self.latest_step()
        if jax.process_count() == 1:
            return mine
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(np.int64(-1 if mine is None else mine)))
        return int(every.max()) if every.max() >= 0 else None

    def all_steps(self) -> list[int]:
        """Steps with a verified (recorded) checkpoint in either tier, oldest first."""
        return sorted({s for s, tier in _candidates(self._tier_list) if _recorded(tier, s) is not None})

    def newest_holds(self) -> set[str]:
        """The top-level keys of the state the newest verified checkpoint holds ("step", "params", "opt_state",
        "rng"; an imported model's has no "opt_state"), from its record's checksums; empty when there is none."""
        record = self.newest_record() or {}
        return {key[2:].split("'")[0] for key in record.get("checksums", {}) if key.startswith("['")}

    def newest_record(self) -> dict | None:
        """The integrity record of the newest verified checkpoint (holds the saved config), or None."""
        for step, tier in _candidates(self._tier_list):
            record = _recorded(tier, step)
            if record is not None:
                return record
        return None

    # ---- saving -----------------------------------------------------------------------------------------------

    def keep_beside(self, files: Sequence[Path]) -> None:
        """Copies `files` (the run's config.json and tokenizer.json) beside the checkpoints when the persistent
        tier is object storage, so that the bucket alone describes and decodes them; nothing for a local tier (the
        run directory beside it holds them). Call on process 0. Raises OSError (or the object store's error)."""
        if self.persistent.remote:
            for f in files:
                paths.write_bytes(paths.join(self.directory, f.name), f.read_bytes())

    def prepare(self, state: Any) -> None:
        """Compiles the checksum programs a save of `state` will run, on a thread of their own, so the first save
        does not wait for them (`integrity.checksum_programs`; the run's last step is saved with or without
        periodic saves). Call once the state exists, before the first step: the compiles then overlap the step's
        own. Not on the checkpoint thread: a save's integrity record must never queue behind them (a checkpoint
        not yet recorded when a worker dies is not restored). `close` joins the thread."""
        if not self.read_only and self._compile_thread is None:
            self._compile_thread = threading.Thread(target=checksum_programs(state), name="msjax-checksum-compile",
                                                    daemon=True)
            self._compile_thread.start()

    def reached_preemption(self, step: int) -> bool:
        """Whether jax's preemption sync point is reached at `step` (multi-process runs with the preemption
        service: every process sees it at the same step); Orbax then saves this step."""
        return self._manager.reached_preemption(step)

    def save(self, step: int, state: Any, loader_state: dict, force: bool = False,
             config: dict | None = None) -> bool:
        """Starts a checkpoint of `step` if Orbax decides one is due (or `force`); returns whether it started.

        Blocks only for stage 1 (device -> host copy) and for a previous checkpoint still in flight, its write or
        its copy to the persistent tier (one at a time). `config` (the run's config as a dict) is stored in the
        record for `--resume` checks.

        Raises:
          CheckpointWriteError: the previous write failed (path and OS error in the message).
          NonFiniteStateError: the previous checkpoint's state held NaN or Inf (deleted before completion).
        """
        if not force and not self._manager.should_save(step):
            return False
        t0 = time.perf_counter()
        # One checkpoint in flight, its copy to the persistent tier included: a copy slower than the save interval
        # shows up here, as the loop's wait, rather than as a queue of steps no tier has completed.
        self._finish_pending(block=True)
        self._reap_worker(block=True)
        t1 = time.perf_counter()
        save = ocp.args.PyTreeSave if self.per_host else ocp.args.StandardSave
        args = ocp.args.Composite(state=save(state), loader=ocp.args.JsonSave(loader_state))
        try:
            started = self._manager.save(step, args=args, force=force)  # Orbax re-checks its policy unless forced
        except Exception as e:  # a synchronous failure (e.g. the directory could not be created)
            raise self._write_error(step, e) from None
        t2 = time.perf_counter()
        # Dispatched now (one single-device reduction per shard), read when the write has finished: not on the
        # loop's critical path. After Orbax's device -> host copy, so on CPU the two do not share the cores. The
        # values are those just copied (nothing ran on the state in between). The next step may donate these
        # buffers; PjRt orders a donating execution after the pending reads of its inputs.
        fetch = checksum_state(state) if started else None
        # Where the loop's blocked time went (seconds), for scripts/bench_checkpoint.py.
        self.last_save_timing = {"wait_previous_s": t1 - t0, "orbax_save_s": t2 - t1,
                                 "checksum_dispatch_s": time.perf_counter() - t2}
        if started:
            # Which of its shards this process uploads is read from the arrays now (metadata only): the next step
            # may donate them before the write is finished.
            extra = {"loader": loader_state, "config": config}
            if self.per_host:  # how many parts make the step whole (msjax.checkpoint.peers)
                extra["writers"] = jax.process_count()
            # Every `persistent_every` steps, and every checkpoint the loop asked for (the last step, a stop, a
            # request) or the preemption sync point set off: the same decision on every process.
            every = self.cfg.persistent_every
            persist = (not self.per_host or force or not every or step % every == 0
                       or self._manager.reached_preemption(step))
            self._pending = (step, fetch, extra,
                             ocp_sync.OperationIdGenerator.get_current_operation_id(),
                             shards.shard_indices(state) if self.per_host else None, persist)
        return bool(started)

    def _write_error(self, step: int, e: BaseException) -> CheckpointWriteError:
        root = _os_error(e)
        return CheckpointWriteError(f"the checkpoint of step {step} could not be written to "
                                    f"{self.write_directory / str(step)}: {type(root).__name__}: {root}")

    def poll(self, step: int) -> None:
        """Called by the loop after each step: finishes a write that Orbax completed (record, copy, rotation) and
        raises the error of one that failed. Never blocks on the device or on I/O.

        Whether Orbax is still writing is each process's own view, so in a multi-process run the processes finish
        a write at different steps: finishing must not enter a collective (two processes once waited forever in
        different ones). Each process publishes its partial checksums through jax's coordination service, and
        process 0's completion thread adds them up before it writes the record.

        Args:
          step: the step just completed.
        Raises:
          CheckpointWriteError: a write or copy failed (path and OS error in the message).
          NonFiniteStateError: the state just written held NaN or Inf; it was deleted, never made complete.
        """
        if self._pending is not None and not self._manager.is_saving_in_progress():
            self._finish_pending(block=False)
        self._reap_worker(block=False)

    def _finish_pending(self, block: bool) -> None:
        if self._pending is None:
            return
        step, fetch, extra, operation_id, host_shards, persist = self._pending
        self._pending = None
        try:
            _wait(f"the checkpoint write of step {step} to {self.write_directory}",
                  self._manager.wait_until_finished, self.cfg.timeout_s)
        except CheckpointWriteError:
            _release_abandoned_save(operation_id)
            raise
        except Exception as e:
            left = _release_abandoned_save(operation_id)
            if left:
                logging.getLogger(__name__).warning("Orbax threads of the failed save still alive: %s", left)
            raise self._write_error(step, e) from None
        if jax.process_count() > 1:
            self._publish_partial(step, fetch)
            if self.per_host:
                job = self._worker.submit(self._complete_on_host, step, None, host_shards, persist, fetch.keys,
                                          extra)
                self._worker_jobs.append((step, job))
            elif jax.process_index() == 0:
                job = self._worker.submit(self._complete_step_of_processes, step, fetch.keys, extra)
                self._worker_jobs.append((step, job))
            if block:
                self._reap_worker(block=True)
            return
        checksums, finite = fetch()
        if not finite:  # never made complete: deleted before its record exists
            with self._rotation:
                if jax.process_index() == 0:
                    shutil.rmtree(self.write_directory / str(step), ignore_errors=True)
                self._manager.reload()
            raise NonFiniteStateError(f"the state of step {step} holds NaN or Inf; its checkpoint was deleted "
                                      f"before completion (the newest complete checkpoint is step "
                                      f"{self.verified_step})")
        record = {"step": step, "checksums": checksums, **extra}
        job = (self._worker.submit(self._complete_on_host, step, record, host_shards, persist) if self.per_host
               else self._worker.submit(self._complete_step, step, record))
        self._worker_jobs.append((step, job))
        if block:
            self._reap_worker(block=True)

    def _kv_key(self, step: int | str, process: int | str) -> str:
        return f"msjax_checkpoint/{self._instance}/{step}/{process}"

    def _publish_partial(self, step: int, fetch) -> None:
        """This process's partial checksums of `step`, to jax's coordination service (no collective)."""
        self._kv_set(self._kv_key(step, jax.process_index()), fetch.local().astype(np.uint64).tobytes())

    def _complete_step_of_processes(self, step: int, keys: list[str], extra: dict) -> None:
        """Process 0's worker thread in a multi-process run: waits (at most checkpoint.timeout_s) for every
        process's partial checksums, adds them, then completes the step as `_complete_step`. A state with NaN or
        Inf is never made complete (its directory is deleted), and the newest complete checkpoint stays."""
        checksums, finite = self._gather_checksums(step, keys)
        if not finite:
            with self._rotation:
                shutil.rmtree(self.write_directory / str(step), ignore_errors=True)
            logging.getLogger(__name__).error("the state of step %d holds NaN or Inf; its checkpoint was deleted "
                                              "before completion", step)
            return
        self._complete_step(step, {"step": step, "checksums": checksums, **extra})

    def _kv_get(self, key: str, what: str, step: int | None = None) -> bytes:
        """A value another process publishes through jax's coordination service, waited for at most
        checkpoint.timeout_s. Raises CheckpointWriteError naming `what` was awaited (for the checkpoint of `step`)."""
        from msjax.compat import jax_distributed

        try:
            return jax_distributed.global_state.client.blocking_key_value_get_bytes(
                key, int(self.cfg.timeout_s * 1000))
        except Exception as e:  # the coordination service's deadline error
            which = f"the checkpoint of step {step} in" if step is not None else "the checkpoints in"
            raise CheckpointWriteError(f"{which} {self.write_directory}: {what} did not arrive within "
                                       f"{self.cfg.timeout_s:.0f} s (checkpoint.timeout_s): {e}") from None

    def _gather_checksums(self, step: int, keys: list[str]) -> tuple[dict, bool]:
        """Process 0: every process's partial checksums of `step` added up (integrity.combine_partials)."""
        every = [np.frombuffer(self._kv_get(self._kv_key(step, p), f"process {p}'s checksums", step),
                               np.uint64).reshape(len(keys), 3) for p in range(jax.process_count())]
        return combine_partials(keys, np.stack(every))

    def _complete_on_host(self, step: int, record: dict | None, host_shards: list[shards.ShardIndex],
                          persist: bool, keys: list[str] | None = None, extra: dict | None = None) -> None:
        """Every process's worker thread, with a local tier: completes this process's part of `step` and, when
        `persist`, copies it to the persistent tier; process 0 writes the persistent tier's record once every part
        is there.

        1. The record: given (one process), or, in a multi-process run, made by process 0 from every process's
           partial checksums and published; the others wait for it (at most checkpoint.timeout_s).
        2. The record is written into this process's local directory: from here this host's part is complete (a
           state with NaN or Inf is deleted instead, on every process, never made complete). With peer replicas,
           this process then copies the parts it keeps replicas of (`_replicate`). Without `persist`, this is all
           but the local rotation.
        3. This process uploads its part (msjax.checkpoint.shards: its share of the chunks of the blocks it holds;
           process 0 also every file that is not a chunk), then says so (or sends its error).
        4. Process 0 waits until every part has arrived, then writes the persistent record, last, and rotates the
           persistent tier. Each process rotates its own local part.
        """
        multi = jax.process_count() > 1
        pid = jax.process_index()
        if record is None:
            record = self._agreed_record(step, keys, extra)
        src = self.local.root / str(step)
        if record is None:  # non-finite: never made complete, on any host
            with self._rotation:
                shutil.rmtree(src, ignore_errors=True)
            if pid == 0:
                logging.getLogger(__name__).error("the state of step %d holds NaN or Inf; its checkpoint was "
                                                  "deleted before completion", step)
            return
        try:
            self._write_record(step, src, record)
        except CheckpointWriteError:
            if self._replica_sources is not None:  # the processes that copy this part wait for word of it
                self._kv_set(self._kv_key(step, f"local-{pid}"), b"null")
            raise
        if self._replica_sources is not None:  # before the upload: a copy on a peer takes seconds, a bucket minutes
            self._replicate(step)
        if not persist:
            with self._rotation:
                _rotate(self.local, self.cfg.local_keep)
            return
        token = f"{self._instance}-{step}"
        error = ""
        try:
            rels = [r for r in self.local.files(step) if r != RECORD_NAME]
            arrays = shards.array_dirs_of(rels)
            owned = shards.owned_chunks(src, host_shards)
            mine = [r for r in rels if (r in owned if shards.is_chunk(r, arrays) else pid == 0)]
            self.persistent.put_files(step, src, mine, token)
            self.last_upload = {"step": step, "chunks": sum(shards.is_chunk(r, arrays) for r in mine),
                                "files": len(mine), "bytes": sum((src / r).stat().st_size for r in mine)}
        except Exception as e:  # noqa: BLE001 - OSError, or the object store's own error types
            error = f"process {pid}: {type(e).__name__}: {str(e)[:300]}"
        if multi:
            self._kv_set(self._kv_key(step, f"uploaded-{pid}"), ("error " + error if error else "ok").encode())
        if error and not (multi and pid == 0):
            raise CheckpointWriteError(f"the checkpoint of step {step} could not be copied to the persistent tier "
                                       f"{self.persistent.path(step)}: {error}")
        if pid == 0:
            errors = [error] if error else []
            for p in range(1, jax.process_count()):
                said = self._kv_get(self._kv_key(step, f"uploaded-{p}"), f"process {p}'s upload", step).decode()
                if said != "ok":
                    errors.append(said.removeprefix("error "))
            if errors:
                raise CheckpointWriteError(f"the checkpoint of step {step} could not be copied to the persistent "
                                           f"tier {self.persistent.path(step)}: {'; '.join(errors)}")
            try:
                self.persistent.put_record(step, src / RECORD_NAME, token)
            except Exception as e:  # noqa: BLE001 - as above
                raise CheckpointWriteError(f"the checkpoint of step {step} could not be completed in the "
                                           f"persistent tier {self.persistent.path(step)}: {type(e).__name__}: "
                                           f"{e}") from None
            with self._rotation:
                _rotate(self.persistent, self.cfg.keep)
        with self._rotation:
            _rotate(self.local, self.cfg.local_keep)

    def _replicate(self, step: int) -> None:
        """Peer replicas, on the worker thread: says that this process's local part of `step` is complete (its
        file list, through jax's coordination service), then copies the parts of the processes it keeps replicas of
        from their hosts into `<local_dir>/replicas/process-<w>/<step>` (msjax.checkpoint.peers: fsynced, the
        record last, renamed into place) and rotates them as its own part. A copy that fails is logged on this
        process and left out: the step is still in its writer's local tier and goes on to the persistent tier, so
        it never fails the checkpoint. Then it waits (at most checkpoint.timeout_s) until the processes that keep
        copies of its own part say they are done: until then this host must go on serving that part (and not
        rotate it away), so the step counts as replicated when its save completes."""
        pid = jax.process_index()
        self._kv_set(self._kv_key(step, f"local-{pid}"), json.dumps(self.local.files(step)).encode())
        t0, received = time.perf_counter(), 0
        for w in self._replica_sources:
            tier = self._replica_tier(w)
            token = f"{self._instance}-{step}"
            tmp = tier.scratch(step, token)
            try:
                files = json.loads(self._kv_get(self._kv_key(step, f"local-{w}"), f"process {w}'s local part", step))
                if files is None:
                    raise OSError(f"process {w} could not complete its local part")
                address, secret = self._peer_servers()[w]
                shutil.rmtree(tmp, ignore_errors=True)
                received += peers.pull(address, secret, f"{peers.writer_dir(w)}/{step}", files, tmp,
                                       self.cfg.timeout_s)
                tier.commit(step, token)
            except (OSError, CheckpointWriteError) as e:
                shutil.rmtree(tmp, ignore_errors=True)
                logging.getLogger(__name__).warning("checkpoint of step %d: no peer replica of process %d's local "
                                                    "part on process %d: %s", step, w, pid, e)
                self._kv_set(self._kv_key(step, f"copied-{w}-by-{pid}"), b"failed")
                continue
            self._kv_set(self._kv_key(step, f"copied-{w}-by-{pid}"), b"ok")
            logging.getLogger(__name__).info("checkpoint of step %d: a copy of process %d's local part is held "
                                             "here (peer replica)", step, w)
            with self._rotation:
                _rotate(tier, self.cfg.local_keep)
        for h in peers.holders(pid, jax.process_count(), self.cfg.local_replicas):
            try:
                self._kv_get(self._kv_key(step, f"copied-{pid}-by-{h}"), f"process {h}'s copy of this part", step)
            except CheckpointWriteError as e:  # said in one warning; the step is still local and persistent
                logging.getLogger(__name__).warning("%s", e)
        self.last_replica = {"step": step, "bytes": received, "seconds": time.perf_counter() - t0}

    def _agreed_record(self, step: int, keys: list[str], extra: dict) -> dict | None:
        """The record of `step` in a multi-process run: process 0 makes it from every process's partial checksums
        and publishes it ("nonfinite" for a state with NaN or Inf); the others wait for it. None: non-finite."""
        key = self._kv_key(step, "record")
        if jax.process_index() == 0:
            checksums, finite = self._gather_checksums(step, keys)
            record = {"step": step, "checksums": checksums, **extra} if finite else None
            self._kv_set(key, json.dumps(record).encode())
            return record
        return json.loads(self._kv_get(key, "process 0's integrity record", step))

    def _kv_set(self, key: str, value: bytes) -> None:
        """Publishes `value` under `key` in jax's coordination service (jax has no public key-value store)."""
        from msjax.compat import jax_distributed

        jax_distributed.global_state.client.key_value_set_bytes(key, value)

    def _write_record(self, step: int, src: Path, record: dict) -> None:
        """Writes `record` into the step directory `src` (fsynced): the step is complete there from here."""
        try:
            write_record(src, record)
        except OSError as e:
            raise CheckpointWriteError(f"the checkpoint of step {step} could not be completed in {src}: "
                                       f"{type(e).__name__}: {e}") from None
        self.verified_step = step

    def _complete_step(self, step: int, record: dict) -> None:
        """Worker thread, without a local tier: writes the record into the persistent tier's step directory (the
        checkpoint is complete from here) and rotates. Runs on process 0 only; other processes return."""
        if jax.process_index() != 0:
            return
        src = self.write_directory / str(step)
        self._write_record(step, src, record)
        with self._rotation:
            _rotate(self.persistent, self.cfg.keep)

    def _reap_worker(self, block: bool) -> None:
        while self._worker_jobs and (block or self._worker_jobs[0][1].done()):
            step, job = self._worker_jobs.pop(0)
            try:
                job.result(timeout=self.cfg.timeout_s)
            except concurrent.futures.TimeoutError:
                raise CheckpointWriteError(f"gave up after {self.cfg.timeout_s:.0f} s waiting for the checkpoint "
                                           f"of step {step} to be completed (checkpoint.timeout_s)") from None
            with self._rotation:  # a later step's job may be rotating now
                self._manager.reload()  # rotation deleted directories under Orbax (here, not in the worker: races)

    def wait(self) -> None:
        """Blocks until every started checkpoint is complete (written, recorded, copied), at most
        `checkpoint.timeout_s` per wait.

        Raises:
          CheckpointWriteError: as `poll`.
        """
        self._finish_pending(block=True)
        self._reap_worker(block=True)

    def close(self) -> None:
        """Waits for the checkpoints in flight (as `wait`) and stops Orbax's and our threads. On an error the
        threads are still stopped (never left to hang the interpreter's exit), then the error is raised."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            # Joined, not just told to stop: an idle pool thread exits only once it wakes to shutdown's sentinel,
            # and a caller that returns straight after close() must find no thread of ours alive (seen: the
            # worker still alive at the driver's thread count on a loaded 2-core machine).
            try:
                _wait("the checkpoint worker thread to end",
                      lambda: self._worker.shutdown(wait=True, cancel_futures=True), self.cfg.timeout_s)
            except Exception:  # noqa: BLE001 - the write error (raised above, or already raised) is the report
                pass
            if self._compile_thread is not None:  # compiles of a few seconds: never left running past the run
                self._compile_thread.join(timeout=self.cfg.timeout_s)
            if self._server is not None:
                self._server.close()
            try:
                _wait(f"Orbax to close the checkpoint manager of {self.write_directory}", self._close_manager,
                      self.cfg.timeout_s)
            except Exception:  # noqa: BLE001 - the write error (raised above, or already raised) is the report
                pass

    def _close_manager(self) -> None:
        try:
            self._manager.close()
        except Exception:  # noqa: BLE001 - a failed write re-raises here again; it was reported once already
            self._manager._checkpointer.close()

    # ---- restoring --------------------------------------------------------------------------------------------

    def restore(self, abstract_state: Any, verify: bool = True, partial: bool = False) -> tuple[int, Any, dict]:
        """Restores (step, state, loader_state) from the newest checkpoint that passes verification, in either
        tier, onto the shardings in `abstract_state` (jax.ShapeDtypeStruct leaves with `.sharding`, possibly
        another mesh). Every checkpoint that fails is reported in one warning line and moved aside to
        `<tier>/rejected/` (so no later save or restore mistakes it for a good one); directories without a
        record (interrupted writes) are deleted.

        Args:
          abstract_state: as above.
          verify: compare every array's checksum with the record (default). False skips only that comparison
            (a record and readable files are still required): for scripts/bench_checkpoint.py, which measures
            what verifying costs; a run always verifies.
          partial: `abstract_state` is a part of the saved state (a dict holding some of its top-level keys,
            e.g. {"params": ...} for generation): only those arrays are read (Orbax's partial restore: the
            optimizer state's bytes never reach memory), only their checksums are compared, and the loader
            position is neither read nor compared (returned as {}).

        Raises:
          CheckpointError: no checkpoint in either tier passes verification (lists what was tried).
        """
        tried = self.skipped = self._interrupted  # the interrupted writes deleted when this checkpointer opened
        self._interrupted = []
        # A partial restore reads each process's own shards: the broadcast of single-replica restore moves whole
        # train states, and a reader of parameters alone (generation, export) is not on the training's mesh.
        replica_plan, why = (replica.plan(abstract_state) if self.cfg.replica_restore and not partial
                             else (None, "partial restore" if partial else "off"))
        self.replica_restore = replica_plan is not None
        if self.cfg.replica_restore and replica_plan is None and why not in _REPLICA_NOTES_LOGGED:
            _REPLICA_NOTES_LOGGED.add(why)  # once per process and reason: bench_checkpoint restores many times
            logging.getLogger(__name__).info("single-replica restore does not apply: %s", why)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            # Every process lists the checkpoints after all have arrived here: process 0 deletes interrupted
            # writes below, and a process that listed after a deletion would walk other candidates than the rest
            # and meet the others in a different collective (seen in a supervised restart: the processes reached
            # the barriers of different discards, and the restart failed).
            multihost_utils.sync_global_devices("msjax-checkpoint-restore-list")
        # What this process reads: its own shards, or, outside the source replica of a single-replica restore,
        # no array at all (the broadcast brings them).
        needs = shards.shard_indices(abstract_state) if replica_plan is None or replica_plan.is_source else []
        local = self._usable_local_steps(needs)
        in_persistent = set(self.persistent.steps())
        self._peer_set = self._survey_peers()
        on_peers = set(self._peer_set.steps) if self._peer_set is not None else set()  # the same on every process
        self.last_download = {"chunks": 0, "bytes": 0, "seconds": 0.0}
        for step in self._agreed_steps(in_persistent | set(local) | on_peers):
            path = self.persistent.path(step)
            reason = None
            try:
                precord = self.persistent.record(step) if step in in_persistent else None
            except ValueError as e:
                precord, reason = None, str(e)
            lrecord = local.get(step)
            everywhere_local = step in on_peers or not _any_process(lrecord is None)
            # Each verdict below is agreed by every process before it acts on it: they read the same files, but
            # a write still landing or a slow filesystem can show them different states, and a process that goes
            # on alone enters the next collective alone.
            if _any_process(precord is None) and not everywhere_local:
                if not _any_process(step in in_persistent):
                    tried.append(f"step {step}: {_SOME_HOSTS_ONLY}")
                    continue
                if precord is None and reason is None:
                    _warn(f"checkpoint {path} has no integrity record (its write was interrupted); skipped")
                    self._discard(self.persistent, step, None)
                    tried.append(f"{path}: interrupted write")
                    continue
                reason = reason or "another process found no valid integrity record"
                _warn(f"checkpoint {path} failed verification ({reason}); trying the next older one")
                self._discard(self.persistent, step, reason)
                tried.append(f"{path}: {reason}")
                continue
            # Round 1 reads this process's local copy when it has one, else the copies on the job's hosts (peer
            # replicas) when they hold the whole step, else the persistent tier's. A copy that does not read or
            # verify is followed by a second round from the persistent tier, a fresh download: a copy damaged on
            # one host, or a transfer garbled on its way, must not cost a good checkpoint. Every process agrees on
            # `reason` at each stage, so all take the same rounds.
            first = "local" if lrecord is not None else "peers" if step in on_peers else "persistent"
            rounds = [first]
            if not _any_process(precord is None) and (_any_process(first != "persistent") or self.persistent.remote):
                rounds.append("persistent")
            for i, source in enumerate(rounds):
                if i:
                    _warn(f"checkpoint {path}: the downloaded copy failed ({reason}); downloading it again"
                          if first == "persistent" else
                          f"checkpoint {self._source_path(step, first)} failed verification ({reason}); reading "
                          f"{path}")
                    reason = None
                record = lrecord if source == "local" else precord if source == "persistent" else None
                fetched, reason, state, loader = self._fetch_and_verify(
                    lambda: self._fetch(step, source, needs), record,
                    abstract_state, replica_plan, partial, verify, reason)
                if reason is None:
                    break
                self._set_aside_copy(step, source, fetched)
            if reason is None:
                self._keep_download(step, fetched)
                self._drop_newer_local(step)
                if verify:
                    self.verified_step = step
                self._manager.reload()
                return step, state, loader
            failed = self._source_path(step, source)
            _warn(f"checkpoint {failed} failed verification ({reason}); trying the next older one")
            if source == "persistent":
                self._discard(self.persistent, step, reason)
            tried.append(f"{failed}: {reason}")
        if any(t.endswith(_SOME_HOSTS_ONLY) for t in tried) and all(
                t.endswith((_SOME_HOSTS_ONLY, ": interrupted write")) for t in tried):
            self._drop_newer_local(-1)  # parts of steps no host can complete: a later save writes those steps again
            self._manager.reload()  # else Orbax, still listing them, would not save those steps here, only elsewhere
            raise NoWholeCheckpointError("no checkpoint is whole on the job's hosts: " + "; ".join(tried))
        raise CheckpointError("no checkpoint passes verification"
                              + (": " + "; ".join(tried) if tried else f" (none in {self.directory})"))

    def _fetch_and_verify(self, fetch: Callable[[], tuple[Path | None, str | None]], record: dict | None,
                          abstract_state: Any, replica_plan: replica.ReplicaPlan | None, partial: bool, verify: bool,
                          reason: str | None) -> tuple[Path | None, str | None, Any, dict | None]:
        """(local copy, None, state, loader position) of one checkpoint that `fetch` makes readable here (a local
        directory, or why not) and that reads and verifies against `record`, or (copy or None, why not, None,
        None); `reason` already set skips it all. Collective: every process agrees on the verdict of each stage
        (fetch, read, verify) before the next (`restore`)."""
        fetched, state, loader = None, None, None
        if reason is None:
            t_fetch = time.perf_counter()
            fetched, reason = fetch()
            if reason is None and record is None:  # a copy from peers: its record came with it, last
                try:
                    record = read_record(fetched)
                except ValueError as e:
                    reason = str(e)
            if _any_process(reason is not None) and reason is None:
                reason = "another process could not fetch it"
        if reason is None:
            try:
                t_read = time.perf_counter()
                state, loader = self._read(fetched, abstract_state, replica_plan, partial)
            except Exception as e:  # noqa: BLE001 - any unreadable file: report one line, try the next
                root = _os_error(e)
                text = str(root).strip().splitlines()[0] if str(root).strip() else ""
                reason = f"unreadable: {type(root).__name__}: {text[:300]}"
            if _any_process(reason is not None) and reason is None:
                reason = "another process could not read it"
        if reason is None:  # outside the try: a fault of ours must not pass for a damaged checkpoint
            t_verify = time.perf_counter()
            expected = record["checksums"]
            if partial:  # the record's arrays under the keys read: a key missing from the state still counts
                heads = tuple(f"[{k!r}]" for k in abstract_state)
                expected = {k: v for k, v in expected.items() if k.startswith(heads)}
            bad = mismatches(expected, checksum_state(state, check_finite=False)()[0]) if verify else []
            self.last_restore_timing = {"fetch_s": t_read - t_fetch, "read_s": t_verify - t_read,
                                        "verify_s": time.perf_counter() - t_verify}
            if bad:
                reason = (f"checksum mismatch in {len(bad)} array(s): {', '.join(bad[:3])}"
                          + (" ..." if len(bad) > 3 else ""))
            elif not partial and loader != record.get("loader"):
                reason = f"loader position {loader} differs from the recorded {record.get('loader')}"
            if _any_process(reason is not None) and reason is None:
                reason = "another process found it does not verify"
        if reason is not None:
            state = loader = None
        return fetched, reason, state, loader

    def _usable_local_steps(self, needs: list[shards.ShardIndex]) -> dict[int, dict]:
        """{step: record} of this process's local copies that are complete (recorded) and hold every chunk that
        reading `needs` touches: the steps this process can restore without the persistent tier."""
        if self.local is None:
            return {}
        out = {}
        for step in self.local.steps():
            record = _recorded(self.local, step)
            if record is None:
                continue
            step_dir = self.local.root / str(step)
            try:
                wanted = shards.needed_chunks(step_dir, needs)
            except (OSError, ValueError, KeyError):
                continue  # not a per-host copy, or one without this array
            if all((step_dir / rel).is_file() for rel in wanted):
                out[step] = record
        return out

    def _survey_peers(self) -> peers.PeerSet | None:
        """With peer replicas: every process publishes what its host's local tier holds (msjax.checkpoint.peers
        `holdings`) and reads everyone's; the steps the job's hosts hold whole between them, the same on every
        process. None without peer replicas."""
        if self._replica_sources is None:
            return None
        self._restores += 1
        pid, root = jax.process_index(), self.local.root.parent
        key = f"inventory-{self._restores}"
        self._kv_set(self._kv_key("peers", f"{key}-{pid}"), json.dumps(peers.holdings(root)).encode())
        inventories = {p: json.loads(self._kv_get(self._kv_key("peers", f"{key}-{p}"), f"process {p}'s inventory"))
                       for p in range(jax.process_count())}
        return peers.PeerSet.from_inventories(pid, self._peer_servers(), root, self.cfg.timeout_s, inventories)

    def _source_path(self, step: int, source: str) -> str:
        """Where a restore read `step` from `source` ("local", "peers", "persistent"), for messages."""
        tier = {"local": self.local, "peers": self._peer_set}.get(source, self.persistent)
        return tier.path(step)

    def _agreed_steps(self, mine: set[int]) -> list[int]:
        """The union of every process's candidate steps, newest first (this process's newest 64 at most)."""
        steps = sorted(mine, reverse=True)[:64]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            padded = np.full(64, -1, np.int64)
            padded[:len(steps)] = steps
            every = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1)
            steps = sorted({int(s) for s in every if s >= 0}, reverse=True)
        return steps

    def _fetch(self, step: int, source: str, needs: list[shards.ShardIndex]) -> tuple[Path | None, str | None]:
        """(a local directory this process reads the step from, None), or (None, why it could not be had).

        "local": this process's local copy. "persistent": the persistent tier's directory itself when it is local
        (each process reads only its shards' chunks there); for object storage a download of only what this
        process reads: every file that is not a chunk (metadata, a few KiB), then the chunks its shards touch
        (msjax.checkpoint.shards), the record last. A step in Orbax's OCDBT layout (written without a local tier)
        is downloaded whole."""
        if source == "local":
            return self.local.root / str(step), None
        tier = self._peer_set if source == "peers" else self.persistent
        if not tier.remote:
            return Path(tier.path(step)), None
        dest = self.local.scratch(step, "restore")
        t0 = time.perf_counter()
        try:
            shutil.rmtree(dest, ignore_errors=True)
            body = [r for r in tier.files(step) if r != RECORD_NAME]
            chunks = None
            if shards.is_zarr_layout(body):
                arrays = shards.array_dirs_of(body)
                tier.fetch_files(step, [r for r in body if not shards.is_chunk(r, arrays)], dest)
                wanted = shards.needed_chunks(dest, needs)
                missing = sorted(wanted - set(body))
                if missing:
                    return None, f"{len(missing)} chunk file(s) missing, e.g. {missing[0]}"
                body = chunks = sorted(wanted)
            tier.fetch_files(step, body, dest)
            tier.fetch_files(step, [RECORD_NAME], dest)
        except Exception as e:  # noqa: BLE001 - the object store's error types vary by backend
            shutil.rmtree(dest, ignore_errors=True)
            return None, f"could not be copied to {dest}: {type(e).__name__}: {str(e)[:300]}"
        self.last_download = {"source": source, "chunks": None if chunks is None else len(chunks),
                              "bytes": sum(p.stat().st_size for p in dest.rglob("*") if p.is_file()),
                              "seconds": time.perf_counter() - t0}
        return dest, None

    def _set_aside_copy(self, step: int, source: str, fetched: Path | None) -> None:
        """After a round that failed: this process's local copy is moved to `<local>/rejected/` (a read-only
        checkpointer leaves it), a download is deleted."""
        if source == "local" and not self.read_only:
            self.local.reject(step)
        elif fetched is not None and (source == "peers" or self.persistent.remote):
            shutil.rmtree(fetched, ignore_errors=True)

    def _drop_newer_local(self, step: int) -> None:
        """Deletes this process's local copies of steps after the restored `step`: a copy complete on this host
        but not on every host (an upload the job did not finish) belongs to a timeline the run abandoned, and left
        in place it would keep Orbax from saving that step again on this host alone, while the others do (their
        checkpoints would then wait for a part that never comes)."""
        if self.local is None or self.read_only:
            return
        for s in self.local.steps():
            if s > step:
                _warn(f"checkpoint {self.local.path(s)}: newer than the step resumed from; deleted")
                self.local.delete(s)
        for w in self._replica_sources or []:  # copies of other processes' parts: the same abandoned timeline
            tier = self._replica_tier(w)
            for s in tier.steps():
                if s > step:
                    tier.delete(s)

    def _keep_download(self, step: int, fetched: Path | None) -> None:
        """A download that restored becomes this process's local copy of the step (complete for this layout: its
        record came last), unless the local tier has one already."""
        if fetched is None or self.local is None or fetched.parent != self.local.root or fetched.name.isdigit():
            return
        if (self.local.root / str(step)).exists():
            shutil.rmtree(fetched, ignore_errors=True)
        else:
            os.replace(fetched, self.local.root / str(step))

    def _read(self, path: Path, abstract_state: Any, replica_plan: replica.ReplicaPlan | None,
              partial: bool = False) -> tuple[Any, dict]:
        """Reads (state, loader position) of one checkpoint: every process its own shards, or, with a replica
        plan, the processes of data-parallel replica 0 read and broadcast (msjax.checkpoint.replica). `partial`:
        only the arrays of `abstract_state`, a part of the saved state (`restore`), and no loader position.

        Raises:
          Exception: whatever Orbax raises for an unreadable checkpoint (on any process: with a replica plan the
            processes first agree that every read succeeded, so none enters the broadcast alone).
        """
        if partial:
            return self._read_in_groups(path, abstract_state), {}
        if replica_plan is None:
            restored = self._reader.restore(path, args=ocp.args.Composite(
                state=self._restore_args(abstract_state), loader=ocp.args.JsonRestore()))
            return restored["state"], dict(restored["loader"])
        error: BaseException | None = None
        local = replica.replica_abstract(abstract_state, replica_plan)
        try:
            if replica_plan.is_source:
                restored = self._reader.restore(path, args=ocp.args.Composite(
                    state=self._restore_args(local), loader=ocp.args.JsonRestore()))
                local = restored["state"]
            else:
                # Reads nothing of the state (it comes from the broadcast), as Orbax's SingleReplicaArrayHandler:
                # Orbax cannot restore an array of which this process holds no shard (serialization.py's
                # _read_and_create_array calls jax.make_array_from_single_device_arrays without a dtype, which
                # raises "If the Array has no addressable shards, `dtype` must be provided").
                restored = self._reader.restore(path, args=ocp.args.Composite(loader=ocp.args.JsonRestore()))
            loader = dict(restored["loader"])
        except Exception as e:  # noqa: BLE001 - raised below, after every process knows
            error = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            failed = multihost_utils.process_allgather(np.int32(error is not None))
            if error is None and np.asarray(failed).any():
                raise CheckpointError(f"another process could not read {path}")
        if error is not None:
            raise error
        return replica.broadcast(local, abstract_state, replica_plan), loader

    def _restore_args(self, abstract_state: Any) -> Any:
        """Orbax's restore arguments for the train state onto `abstract_state`'s shardings: the standard handler's,
        or, with the per-host handlers, the PyTree handler's (the standard one is a PyTree handler underneath)."""
        if not self.per_host:
            return ocp.args.StandardRestore(abstract_state)
        return ocp.args.PyTreeRestore(item=abstract_state,
                                      restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))

    def _read_in_groups(self, path: Path, abstract_state: Any) -> Any:
        """The arrays of `abstract_state` (a part of the saved state) read from checkpoint `path`, in groups of
        about 1/PARTIAL_READ_GROUPS of their bytes (whole arrays): Orbax holds each array's read buffers beside
        the array it builds, so one call for all of them peaks near twice their bytes; in groups the peak is the
        arrays plus one group's buffers (measured on a 298M-parameter model, 1.14 GiB of float32: 1.80x in one
        call, 1.10x in 32 groups, 1.08x one array at a time; each call also reads the checkpoint's metadata,
        about 0.08 s there)."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        sizes = [int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for _, a in leaves]
        budget = sum(sizes) / PARTIAL_READ_GROUPS
        groups: list[list[int]] = [[]]
        for i, size in enumerate(sizes):
            if groups[-1] and sum(sizes[j] for j in groups[-1]) + size > budget:
                groups.append([])
            groups[-1].append(i)
        out: list[Any] = [None] * len(leaves)
        for group in groups:
            item: dict = {}
            for i in group:  # a nested dict holding this group's arrays alone, under their own key paths
                keys = [_path_key(k) for k in leaves[i][0]]
                node = item
                for k in keys[:-1]:
                    node = node.setdefault(k, {})
                node[keys[-1]] = leaves[i][1]
            # PyTreeRestore reads what StandardSave wrote (the standard handler is a PyTree handler underneath);
            # partial_restore leaves every array not named in `item` unread.
            restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, dtype=a.dtype), item)
            got = self._reader.restore(path, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True)))["state"]
            for i in group:
                node = got
                for k in leaves[i][0]:
                    node = node[_path_key(k)]
                out[i] = node
        return jax.tree_util.tree_unflatten(treedef, out)

    def _discard(self, tier: LocalTier | ObjectTier, step: int, reason: str | None) -> None:
        """Moves a failed checkpoint to `<tier>/rejected/<step>-<time>` (kept for inspection), or deletes an
        interrupted write (`reason` None); the record goes first either way. Process 0 acts; the others wait.
        A read-only checkpointer leaves it where it is (the restore still passes over it)."""
        if self.read_only:
            return
        if jax.process_index() == 0:
            if reason is None:
                tier.delete(step)
            else:
                tier.reject(step)
        _meet(f"discard_{tier.name}_{step}", self.cfg.timeout_s)
        self._manager.reload()
