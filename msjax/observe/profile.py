"""Profiling on demand: a `jax.profiler` trace of steps K..K+N-1 into the run directory, without a restart.

Requests come through `LoopControl.request_profile(K, N)`: from the control plane, from `observe.profile_steps`
("K:N", at start) or from SIGUSR1 (single-process runs: the next `observe.profile_signal_steps` steps). The trace
starts after step K-1 was dispatched and stops after step K+N-1's results are ready (the one sync this adds, only
while profiling), and lands in `<run_dir>/profile/steps_<K>-<K+N-1>/process<i>/` as TensorBoard's profile plugin
layout (`plugins/profile/<time>/*.xplane.pb`) plus `perfetto_trace.json.gz` (opens in ui.perfetto.dev).

Each traced step leaves a marker event named `msjax_step <s>` on the host timeline when it is dispatched, so a
trace can be matched to its steps (`traced_steps`).
"""

from __future__ import annotations

import glob
import gzip
import json
import logging
import re
import signal
import threading
from pathlib import Path
from typing import Any

import jax

from msjax.hooks import Hook, RunContext
from msjax.events import append_event

log = logging.getLogger(__name__)

MARKER = "msjax_step"


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
    """'K:N' -> (K, N); '' -> None. Raises ValueError for anything else (config validation names the key)."""
    if not spec:
        return None
    first, _, count = spec.partition(":")
    if not (first.isdigit() and count.isdigit() and int(first) >= 1 and int(count) >= 1):
        raise ValueError(f"profile steps {spec!r}: allowed is 'K:N' with K >= 1 and N >= 1")
    return int(first), int(count)


def traced_steps(trace_dir: str | Path) -> list[int]:
    """Steps whose `msjax_step` markers are in the Perfetto trace(s) under `trace_dir`, sorted.

    Raises FileNotFoundError when no `perfetto_trace.json.gz` is there.
    """
    files = glob.glob(str(Path(trace_dir) / "**" / "perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    steps = set()
    for f in files:
        with gzip.open(f, "rt") as fh:
            events = json.load(fh)
        events = events["traceEvents"] if isinstance(events, dict) else events
        for e in events:
            m = re.fullmatch(rf"{MARKER} (\d+)", str(e.get("name", "")))
            if m:
                steps.add(int(m.group(1)))
    return sorted(steps)


def scope_share(trace_dir: str | Path, hlo_text: str, scope: str) -> dict[str, float]:
    """How much of a program's device time went to the ops traced under `jax.named_scope(scope)`.

    Reads the Perfetto trace(s) under `trace_dir` of runs of one compiled program whose HLO text (`compiled.
    as_text()`) is `hlo_text`: each op event is named after its HLO instruction, whose metadata `op_name` carries
    the named scopes it was traced under. Durations are summed over every device (thread) and event.

    Returns:
      {"scope_s", "ops_s": seconds in the scope's ops and in all of the program's ops, "share": their ratio}.
    Raises:
      FileNotFoundError: no `perfetto_trace.json.gz` under `trace_dir`.
    """
    names: dict[str, bool] = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]*)\"", line)
        if m:
            names[m.group(1)] = f"/{scope}/" in f"/{m.group(2)}/"
        else:
            m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = ", line)
            if m:
                names.setdefault(m.group(1), False)
    files = glob.glob(str(Path(trace_dir) / "**" / "perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    inside = total = 0.0
    for f in files:
        with gzip.open(f, "rt") as fh:
            events = json.load(fh)
        for e in events["traceEvents"] if isinstance(events, dict) else events:
            name = e.get("name")
            if e.get("ph") == "X" and name in names:
                total += e.get("dur", 0) * 1e-6
                inside += e.get("dur", 0) * 1e-6 if names[name] else 0.0
    return {"scope_s": inside, "ops_s": total, "share": inside / total if total else 0.0}


class ProfileHook(Hook):
    """Captures profiler traces when `LoopControl` asks for one (see the module docstring).

    Args:
      profile_steps: "K:N" to trace from the start (`observe.profile_steps`), or "".
      signal_steps: steps traced per SIGUSR1.
      install_signal: install the SIGUSR1 handler (only possible from the main thread; skipped otherwise).
    """

    def __init__(self, profile_steps: str = "", signal_steps: int = 3, install_signal: bool = True):
        self.initial = parse_profile_steps(profile_steps)
        self.signal_steps = signal_steps
        self.install_signal = install_signal
        self.traces: list[dict[str, Any]] = []
        self._pending: tuple[int, int] | None = None
        self._active: tuple[int, int, Path] | None = None
        self._step = 0
        self._old_handler: Any = None

    def on_start(self, ctx: RunContext) -> None:
        self._step = ctx.start_step
        if self.initial:
            self._pending = self.initial
            self._maybe_start(ctx, ctx.start_step + 1)
        if (self.install_signal and jax.process_count() == 1 and hasattr(signal, "SIGUSR1")
                and threading.current_thread() is threading.main_thread()):
            def on_signal(signum, frame):
                ctx.control.request_profile(self._step + 1, self.signal_steps)

            self._old_handler = signal.signal(signal.SIGUSR1, on_signal)

    def on_step_end(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        self._step = step
        if self._active is not None:
            first, last, out = self._active
            with jax.profiler.TraceAnnotation(f"{MARKER} {step}"):
                pass
            if step >= last:
                jax.block_until_ready(metrics)
                self._stop(ctx, step)
        request = ctx.control.take_profile_request()
        if request is not None:
            self._pending = request  # a newer request replaces one not yet started
        self._maybe_start(ctx, step + 1)

    def _maybe_start(self, ctx: RunContext, next_step: int) -> None:
        """Starts the pending trace if it begins at or before `next_step` (the step about to be dispatched)."""
        if self._active is not None or self._pending is None or self._pending[0] > next_step:
            return
        first, count = self._pending
        self._pending = None
        if first < next_step:
            log.info(f"observe: profile of steps {first}:{count} asked before step {next_step}: tracing from "
                     f"step {next_step} instead")
            first = next_step
        last = min(first + count - 1, ctx.config.train.steps)
        out = Path(ctx.run_dir) / "profile" / f"steps_{first}-{last}" / f"process{jax.process_index()}"
        out.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(out), create_perfetto_trace=True)
        self._active = (first, last, out)

    def _stop(self, ctx: RunContext, step: int) -> None:
        first, last, out = self._active
        self._active = None
        jax.profiler.stop_trace()
        info = {"first_step": first, "last_step": min(last, step), "path": str(out)}
        self.traces.append(info)
        if jax.process_index() == 0:
            log.info(f"observe: profile of steps {first}-{info['last_step']} written to {out}")
            append_event(ctx.run_dir, "profile", **info)

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        if self._active is not None:
            self._stop(ctx, self._step)
        if self._old_handler is not None:
            signal.signal(signal.SIGUSR1, self._old_handler)
            self._old_handler = None
