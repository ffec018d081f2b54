"""Straggler detection: pure functions over per-rank figures, and each process's place in the mesh.

A synchronous SPMD step ends at the same instant on every rank (its collectives wait for the last arrival), so
step times cannot show a straggler. What can is each rank's *own share* of the step: the time it needs before it
joins the collectives (its forward and backward compute, timed inside the step as each device arrives at the
gradient reduction, `msjax.parallel.arrival`; its host work). `msjax.observe.timing` measures such figures per
rank and per window of steps; this module compares them across ranks. Figures may be advisory: scored and
reported, never flagging a rank by themselves (the collective-free probe).

Score (in the spirit of Megatron-LM's `--log-straggler` and NVIDIA Resiliency Extension's relative scores): for
rank r and window w, `slowdown[r, w] = x[r, w] / max(median_{j != r} x[j, w], floor)`: the rank's figure over the
median of the *other* ranks (leave-one-out, so that with two ranks each is compared with the other, and with many
it is the ordinary cross-rank median). A rank is a straggler when its slowdown is at least `threshold` in each of
the last `persist` windows: one slow window (a page-cache miss, a neighbour's burst) is not enough.

The exchange that brings every rank's figures together is not here: `timing.StepObserver` gathers them with jax's
multihost all-gather at window boundaries; a control plane may feed the same functions from its store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from msjax.sharding_rules.axes import MESH_AXES


def leave_one_out_median(x_r: np.ndarray) -> np.ndarray:
    """For each rank, the median of the other ranks' values.

    Args:
      x_r: (R,) float, one figure per rank; R >= 2.
    Returns:
      (R,) float.
    Raises:
      ValueError: fewer than two ranks (there is nobody to compare with).
    """
    x_r = np.asarray(x_r, dtype=np.float64)
    if x_r.ndim != 1 or x_r.shape[0] < 2:
        raise ValueError(f"leave_one_out_median needs a 1-D array of at least 2 ranks, got shape {x_r.shape}")
    return np.array([np.median(np.delete(x_r, r)) for r in range(x_r.shape[0])])


def slowdown_scores(x_rw: np.ndarray, floor: float = 0.0) -> np.ndarray:
    """Relative slowdown of every rank in every window: `x[r, w] / max(median of the other ranks, floor)`.

    Args:
      x_rw: (R, W) float, a per-rank figure (seconds; larger is slower) for R ranks and W windows.
      floor: a lower bound of the denominator in the figure's unit, so that a figure whose median is ~0 (e.g.
        host stall time on healthy ranks) does not turn microsecond noise into huge ratios.
    Returns:
      (R, W) float: 1.0 is "like the others", 2.0 "twice as long as the others' median". With a single rank
      every score is 1.0.
    """
    x_rw = np.asarray(x_rw, dtype=np.float64)
    if x_rw.ndim != 2:
        raise ValueError(f"slowdown_scores needs (ranks, windows), got shape {x_rw.shape}")
    if x_rw.shape[0] < 2:
        return np.ones_like(x_rw)
    ref = np.stack([leave_one_out_median(x_rw[:, w]) for w in range(x_rw.shape[1])], axis=1)
    return x_rw / np.maximum(ref, max(floor, 1e-12))


def persistent_stragglers(scores_rw: np.ndarray, threshold: float, persist: int) -> list[int]:
    """Ranks whose slowdown is >= threshold in each of the last `persist` windows.

    Args:
      scores_rw: (R, W) slowdown scores (`slowdown_scores`).
      threshold: e.g. 1.5: at least 50% slower than the others' median.
      persist: number of consecutive latest windows that must all exceed the threshold (>= 1).
    Returns:
      sorted rank indices; empty when fewer than `persist` windows exist.
    Raises:
      ValueError: threshold <= 1 or persist < 1.
    """
    if threshold <= 1.0 or persist < 1:
        raise ValueError(f"threshold={threshold}, persist={persist}: allowed is threshold > 1 and persist >= 1")
    scores_rw = np.asarray(scores_rw)
    if scores_rw.shape[1] < persist:
        return []
    return [int(r) for r in np.nonzero((scores_rw[:, -persist:] >= threshold).all(axis=1))[0]]


@dataclass(frozen=True)
class RankPlace:
    """Where one process sits: its host and the mesh coordinates of the devices it drives.

    Attributes:
      process: jax process index.
      host: host name (as the process reported it; "" when unknown).
      coords: axis name -> sorted distinct coordinates of this process's devices on that axis
        (axes `pipeline, data, fsdp, sequence, tensor`; "stage" in MegaScale's words is `pipeline`).
      devices: global device ids of its devices.
    """

    process: int
    host: str
    coords: dict[str, list[int]]
    devices: list[int]

    def describe(self) -> str:
        """e.g. 'process 1 on host-a (pipeline 0, data 1, fsdp 0-1, expert 0, sequence 0, tensor 0-1)'."""
        def span(v: list[int]) -> str:
            return str(v[0]) if len(v) == 1 else (f"{v[0]}-{v[-1]}" if v == list(range(v[0], v[-1] + 1))
                                                   else ",".join(map(str, v)))
        where = ", ".join(f"{a} {span(self.coords[a])}" for a in MESH_AXES if a in self.coords)
        return f"process {self.process}" + (f" on {self.host}" if self.host else "") + f" ({where})"

    def to_dict(self) -> dict[str, Any]:
        return {"process": self.process, "host": self.host, "coords": self.coords, "devices": self.devices}


def mesh_places(mesh_devices: np.ndarray, axis_names: Sequence[str] = MESH_AXES,
                hosts: dict[int, str] | None = None) -> dict[int, RankPlace]:
    """Each process's mesh coordinates, from the mesh's device array.

    Args:
      mesh_devices: the mesh's device array (`mesh.devices`), one axis per name in `axis_names`; anything with
        `.process_index` and `.id` attributes.
      axis_names: the mesh axis names, outer to inner.
      hosts: process index -> host name (optional).
    Returns:
      process index -> RankPlace.
    """
    if mesh_devices.ndim != len(axis_names):
        raise ValueError(f"mesh device array has {mesh_devices.ndim} axes but {len(axis_names)} names given")
    per_proc: dict[int, dict[str, set[int]]] = {}
    devs: dict[int, list[int]] = {}
    for idx in np.ndindex(mesh_devices.shape):
        d = mesh_devices[idx]
        c = per_proc.setdefault(d.process_index, {a: set() for a in axis_names})
        for a, i in zip(axis_names, idx):
            c[a].add(int(i))
        devs.setdefault(d.process_index, []).append(int(d.id))
    hosts = hosts or {}
    return {p: RankPlace(p, hosts.get(p, ""), {a: sorted(v) for a, v in c.items()}, sorted(devs[p]))
            for p, c in sorted(per_proc.items())}


@dataclass
class WindowVerdict:
    """The detector's answer for one window.

    Attributes:
      scores: figure -> (R,) slowdown of each rank in this window.
      stragglers: ranks flagged now (persistently slow on at least one figure).
      new: ranks flagged now but not in the previous window.
      recovered: ranks flagged in the previous window but not now.
    """

    scores: dict[str, np.ndarray]
    stragglers: list[int]
    new: list[int]
    recovered: list[int]


class StragglerDetector:
    """Keeps the per-window history of per-rank figures and flags persistent stragglers.

    Feed it each window's figures of every rank (from jax's all-gather, or from a control-plane store).

    Args:
      floors: figure name -> floor of the score's denominator as a fraction of the median step time
        (`slowdown_scores`); only these figures are scored.
      threshold, persist: see `persistent_stragglers`.
      advisory: figures of `floors` that are scored and reported but never flag a rank (a second signal).
    Raises:
      ValueError: threshold <= 1, persist < 1, or an advisory figure that is not in `floors`.
    """

    def __init__(self, floors: dict[str, float], threshold: float, persist: int, advisory: Sequence[str] = ()):
        if threshold <= 1.0 or persist < 1:
            raise ValueError(f"threshold={threshold}, persist={persist}: allowed is threshold > 1, persist >= 1")
        if set(advisory) - set(floors):
            raise ValueError(f"advisory figures {sorted(set(advisory) - set(floors))} are not scored figures "
                             f"{sorted(floors)}")
        self.floors, self.threshold, self.persist = dict(floors), threshold, persist
        self.advisory = frozenset(advisory)
        self._history: dict[str, list[np.ndarray]] = {k: [] for k in floors}
        self._flagged: set[int] = set()

    def update(self, figures: dict[str, np.ndarray], step_s: float, unscored: Sequence[str] = ()) -> WindowVerdict:
        """Adds one window.

        Args:
          figures: figure name -> (R,) values of every rank (seconds); must hold every figure in `floors` that is
            not in `unscored`.
          step_s: the window's median step time (seconds), the unit of the floors.
          unscored: figures not to score in this window (a measurement known to be unreliable in it): the window
            is left out of their history, so persistence counts the windows that were scored, and their verdict
            carries over from the previous window.
        Raises:
          KeyError: a scored figure is missing.
        """
        scores, flagged = {}, set()
        for fig, floor_frac in self.floors.items():
            if fig not in unscored:
                self._history[fig].append(np.asarray(figures[fig], np.float64))
            if not self._history[fig]:
                continue
            s = slowdown_scores(np.stack(self._history[fig], axis=1), floor=floor_frac * step_s)
            if fig not in unscored:
                scores[fig] = s[:, -1]
            if fig not in self.advisory:
                flagged.update(persistent_stragglers(s, self.threshold, self.persist))
        verdict = WindowVerdict(scores, sorted(flagged), sorted(flagged - self._flagged),
                                sorted(self._flagged - flagged))
        self._flagged = flagged
        return verdict
