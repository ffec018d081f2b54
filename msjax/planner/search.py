"""`--search`: every legal layout of a config on N devices, ranked by predicted MFU among those that fit.

The space: every mesh (pipeline, data, fsdp, expert, sequence, tensor) whose sizes multiply to N (expert above 1
only for a mixture of experts, dividing its experts, and with sequence and tensor inside a node:
`layout.check_expert_split`), every microbatch size
dividing the per-replica batch, every legal interleaving (virtual stages), every remat policy; the ZeRO stage
over `data` is then the fastest one that fits (see `_zero_order`). The
config's own mesh sizes and remat policy are ignored (they are what is searched); --tune_virtual_stages=false and
--tune_microbatches=false restrict the search to the config's `pipeline.virtual_stages` and microbatch
(`msjax.planner.layout.config_microbatch_size`), and an explicit --zero_stage to that stage.

Every candidate that is not ranked carries its reason: a mesh that does not divide the model or the batch (the
same PlanError message a single plan gives), or memory (bytes needed vs capacity). Pruning is exact: a mesh is
rejected whole only if its smallest-memory variant (microbatch 1, plain 1F1B, ZeRO-2, the leanest remat) does
not fit,
and larger microbatches are not tried once a microbatch size fits under no policy (activations grow with it).

Schedules. The space above is priced under the interleaved schedule (a closed-form bubble). The table schedules
(1f1b, zb-h1, zb-v; `pipeline.schedule`) are priced by simulating their flush tick by tick
(`msjax.parallel.zero_bubble.flush_seconds`), milliseconds each, too slow for every one of ~10^5 layouts: they
are tried on the meshes and microbatch sizes of the best `TABLE_TOP` interleaved candidates with pipeline stages
(every remat policy, the fastest ZeRO stage that fits) and ranked with them. A mesh on which only a table schedule
fits is therefore not found (not exact, unlike the pruning above). With `pipeline.schedule` set on the command
line the search keeps to that schedule.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import time
from dataclasses import dataclass, field

from msjax.config import Config
from msjax.planner import memory as mem
from msjax.planner import timing
from msjax.planner.layout import (
    check_model_split, config_microbatch_size, fast_replace, legal_virtual_stages, make_layout, replica_batch,
    SEARCH_AXES, resolve_vocab, schedule_choices, search_sizes,
)
from msjax.planner.options import REMATS, PlanError, PlanOptions
from msjax.planner.plan import Plan, evaluate, get_hardware

GiB = 2**30


@dataclass(frozen=True)
class Candidate:
    """One searched layout: the axis sizes (every mesh axis, `layout.SEARCH_AXES`), virtual stages, microbatch
    size, ZeRO stage and remat policy, with its prediction (fits: mfu, step seconds) or its rejection reason."""

    sizes: tuple[int, ...]
    virtual_stages: int
    microbatch_size: int
    zero_stage: int
    remat: str
    mfu: float
    step: float
    memory: float
    reason: str
    schedule: str = "interleaved"

    def describe(self) -> str:
        a = search_sizes(self.sizes)
        p, d, f, s, t = a["pipeline"], a["data"], a["fsdp"], a["sequence"], a["tensor"]
        ep = f" ep={a['expert']}" if a["expert"] > 1 else ""
        if not self.virtual_stages:  # a mesh-level rejection: only the sizes are known
            return f"pp={p} dp={d} fsdp={f}{ep} sp={s} tp={t}" + (f" mb={self.microbatch_size}+"
                                                                     if self.microbatch_size else "")
        sched = f" {self.schedule}" if self.schedule != "interleaved" else ""
        return (f"pp={p}x{self.virtual_stages}v{sched} dp={d} fsdp={f}{ep} sp={s} tp={t} mb={self.microbatch_size} "
                f"zero={self.zero_stage} remat={self.remat}")

    def to_dict(self) -> dict:
        out = search_sizes(self.sizes)
        out.update(virtual_stages=self.virtual_stages, microbatch_size=self.microbatch_size,
                   zero_stage=self.zero_stage, remat=self.remat, schedule=self.schedule)
        if self.reason:
            out["rejected"] = self.reason
        else:
            out.update(mfu=self.mfu, step_s=self.step, memory_bytes=self.memory)
        return out


@dataclass
class SearchResult:
    """ranked: fitting candidates, best MFU first. rejected: everything else with its reason. meshes: mesh
    shapes considered; legal_meshes: those that divide; evaluated: step-time evaluations; seconds: wall time."""

    ranked: list[Candidate] = field(default_factory=list)
    rejected: list[Candidate] = field(default_factory=list)
    meshes: int = 0
    legal_meshes: int = 0
    evaluated: int = 0
    seconds: float = 0.0

    def best_plan(self, cfg: Config, opts: PlanOptions) -> Plan | None:
        """The full Plan of the top-ranked candidate (or None if nothing fits)."""
        if not self.ranked:
            return None
        c = self.ranked[0]
        return plan_candidate(cfg, opts, c)

    def reason_counts(self) -> dict[str, int]:
        """Rejections grouped by kind (the reason up to its first digit-bearing detail)."""
        counts: dict[str, int] = {}
        for c in self.rejected:
            key = reason_kind(c.reason)
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def reason_kind(reason: str) -> str:
    """The class of a rejection reason ("out of memory", "... is not divisible by ...", ...), used to count and
    exemplify rejected layouts by kind."""
    if reason.startswith("out of memory"):
        return "out of memory"
    for marker in (" is not divisible by ", " is more than ", " does not split over ", " is not a multiple of ",
                   " splits the ", " does not divide ", " does not fit a node "):
        if marker in reason:
            head = reason.split(marker)[0].split("=")[0]
            return f"{head}{marker.rstrip()}"
    return reason[:60]


def factorizations(n: int, parts: int = len(SEARCH_AXES)) -> list[tuple[int, ...]]:
    """Every ordered tuple of `parts` positive integers whose product is n."""
    if parts == 1:
        return [(n,)]
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out += [(d,) + rest for rest in factorizations(n // d, parts - 1)]
    return out


def search_meshes(cfg: Config, devices: int) -> list[tuple[int, ...]]:
    """The mesh shapes `search` considers, as SEARCH_AXES tuples: every factorization of the device count, with
    `expert` above 1 only where it divides a mixture of experts' experts (a dense model keeps expert = 1, so its
    space is the five other axes'). Node and divisibility rules are checked per candidate (`make_layout`)."""
    e = SEARCH_AXES.index("expert")
    experts = cfg.model.moe.num_experts
    if not experts:
        return [rest[:e] + (1,) + rest[e:] for rest in factorizations(devices, len(SEARCH_AXES) - 1)]
    return [m for m in factorizations(devices) if experts % m[e] == 0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_candidate(cfg: Config, opts: PlanOptions, c: Candidate) -> Plan:
    hw = get_hardware(opts)
    sizes = search_sizes(c.sizes)
    layout = make_layout(cfg, opts, hw, sizes, c.virtual_stages, c.microbatch_size, c.zero_stage, c.remat,
                         c.schedule)
    return evaluate(cfg, opts, hw, layout)


# Interleaved candidates whose meshes and microbatch sizes the table schedules are tried on (module docstring).
TABLE_TOP = 20


def search(cfg: Config, opts: PlanOptions, workers: int = 0, schedule_fixed: bool = False) -> SearchResult:
    """Enumerates and ranks every legal layout (see module docstring).

    Args:
      cfg: the config (its mesh sizes and remat policy are what is searched, so they are ignored).
      opts: devices, hardware and any knobs fixed by the user.
      workers: processes to spread the meshes over (0: serial on <= 2 cores, else one per core, at most 8).
      schedule_fixed: the user set `pipeline.schedule`: only that schedule is searched.
    Raises:
      PlanError: unknown hardware or vocabulary.
    """
    t0 = time.perf_counter()
    opts = opts.validate()
    get_hardware(opts)
    resolve_vocab(cfg)
    meshes = search_meshes(cfg, opts.devices)
    # Shipping ~10^5 results back costs more than a second core gains on a 2-core machine (measured: 18 s serial,
    # 21 s with 2 processes for 175B on 12,288 devices), so processes are used only with more cores.
    cores = os.cpu_count() or 1
    workers = workers or (1 if cores <= 2 else min(8, cores))
    if workers > 1 and len(meshes) > 64:
        chunks = [meshes[i::workers] for i in range(workers)]
        ctx = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            parts = list(pool.map(_search_meshes, [cfg] * workers, [opts] * workers, chunks))
    else:
        parts = [_search_meshes(cfg, opts, meshes)]
    result = SearchResult()
    for part in parts:
        result.ranked += part.ranked
        result.rejected += part.rejected
        result.meshes += part.meshes
        result.legal_meshes += part.legal_meshes
        result.evaluated += part.evaluated
    schedules = schedule_choices(cfg, opts, 2, schedule_fixed)
    if "interleaved" not in schedules:  # the user's table schedule alone, on the best interleaved meshes
        top = [c for c in sorted(result.ranked, key=lambda c: -c.mfu) if c.sizes[0] > 1][:TABLE_TOP]
        result.ranked = [c for c in result.ranked if c.sizes[0] == 1]
    else:
        top = [c for c in sorted(result.ranked, key=lambda c: -c.mfu) if c.sizes[0] > 1][:TABLE_TOP]
    result.ranked += _table_variants(cfg, opts, top, [s for s in schedules if s != "interleaved"], result)
    result.ranked.sort(key=lambda c: (-c.mfu, c.sizes, c.schedule, c.virtual_stages, c.microbatch_size, c.remat))
    result.seconds = time.perf_counter() - t0
    return result


def _table_variants(cfg: Config, opts: PlanOptions, top: list[Candidate], schedules: list[str],
                    result: SearchResult) -> list[Candidate]:
    """The table schedules on the meshes and microbatch sizes of `top` (module docstring): every remat policy,
    the fastest ZeRO stage that fits. Counts its evaluations into `result`; what does not fit is not listed."""
    hw = get_hardware(opts)
    vocab = resolve_vocab(cfg)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    out, seen = [], set()
    for c in top:
        sizes = search_sizes(c.sizes)
        stage = mem.stage_params(cfg, vocab, sizes)
        for schedule in schedules:
            if (c.sizes, c.microbatch_size, schedule) in seen:
                continue
            seen.add((c.sizes, c.microbatch_size, schedule))
            v = {"zb-v": 2}.get(schedule, 1)
            for remat in REMATS:
                for z in _zero_order(opts, sizes["data"]):
                    try:
                        lay = make_layout(cfg, opts, hw, sizes, v, c.microbatch_size, z, remat, schedule)
                    except PlanError:
                        break
                    rep = mem.memory_report(cfg, lay, stage, hw.memory_bytes, opts.memory_fraction)
                    if not rep.fits:
                        continue
                    st = timing.step_time(cfg, lay, hw, opts, stage)
                    result.evaluated += 1
                    mfu = timing.model_flops_per_token(cfg, lay) * tokens / (st.step * opts.devices * hw.peak_flops)
                    out.append(Candidate(c.sizes, v, c.microbatch_size, z, remat, mfu, st.step, rep.total, "",
                                         schedule))
                    break
    return out


def _zero_order(opts: PlanOptions, data: int) -> list[int]:
    """ZeRO stages to try, in order: the user's, else 0 without data parallelism, else 1 then 2. ZeRO-0 is
    never faster than ZeRO-1 (same collective volume, the update runs over all the state instead of 1/d of it),
    and ZeRO-1 and -2 have equal time, so the smallest stage >= 1 that fits is the fastest that fits."""
    if opts.zero_stage >= 0:
        return [opts.zero_stage]
    return [0] if data == 1 else [1, 2]


def _search_meshes(cfg: Config, opts: PlanOptions, meshes: list[tuple[int, ...]]) -> SearchResult:
    hw = get_hardware(opts)
    vocab = resolve_vocab(cfg)
    result = SearchResult()
    tokens = cfg.train.global_batch * cfg.train.seq_len
    flops_token: dict = {}
    capacity = opts.memory_fraction * hw.memory_bytes
    for sizes_t in meshes:
        result.meshes += 1
        sizes = search_sizes(sizes_t)
        try:
            check_model_split(cfg, sizes, vocab)
            per_replica = replica_batch(cfg, sizes)
            probe = make_layout(cfg, opts, hw, sizes, 1, 1, 2, "full")
        except PlanError as err:
            result.rejected.append(Candidate(sizes_t, 0, 0, 0, "", 0.0, 0.0, 0.0, str(err)))
            continue
        result.legal_meshes += 1
        stage = mem.stage_params(cfg, vocab, sizes)
        floor = min((mem.memory_report(cfg, dataclasses.replace(probe, remat=r), stage, hw.memory_bytes,
                                       opts.memory_fraction) for r in REMATS), key=lambda rep: rep.total)
        if not floor.fits:
            result.rejected.append(Candidate(
                sizes_t, 1, 1, 2, "", 0.0, 0.0, floor.total,
                f"out of memory: needs {floor.total / GiB:.1f} GiB even with microbatch 1, plain 1F1B, ZeRO-2 "
                f"and the leanest remat (capacity {floor.capacity / GiB:.1f} GiB)"))
            continue
        fpt = flops_token.get(probe.window)
        if fpt is None:
            fpt = flops_token[probe.window] = timing.model_flops_per_token(cfg, probe)
        if opts.tune_microbatches:
            mbs = _divisors(per_replica)
        else:
            try:
                mbs = [config_microbatch_size(cfg, sizes)]
            except PlanError as err:
                result.rejected.append(Candidate(sizes_t, 0, 0, 0, "", 0.0, 0.0, 0.0, str(err)))
                continue
        zeros = _zero_order(opts, sizes["data"])
        for b in mbs:
            if per_replica % b:
                result.rejected.append(Candidate(sizes_t, 0, b, 0, "", 0.0, 0.0, 0.0,
                                                 f"microbatch size {b} does not divide the {per_replica} "
                                                 "sequences per replica"))
                continue
            m = per_replica // b
            vs = legal_virtual_stages(cfg.model.num_layers, sizes["pipeline"], m)
            if not opts.tune_virtual_stages:
                vs = [v for v in vs if v == cfg.pipeline.virtual_stages]
            any_fit = False
            for v in vs:
                base = fast_replace(probe, virtual_stages=v, microbatch_size=b, microbatches=m)
                for remat in REMATS:
                    lay = fast_replace(base, remat=remat)
                    chosen, need = None, None
                    for z in zeros:
                        lz = fast_replace(lay, zero_stage=z)
                        rep = mem.memory_report(cfg, lz, stage, hw.memory_bytes, opts.memory_fraction)
                        need = rep.total
                        if rep.fits:
                            chosen = lz
                            break
                    if chosen is None:
                        result.rejected.append(Candidate(
                            sizes_t, v, b, zeros[-1], remat, 0.0, 0.0, need,
                            f"out of memory: needs {need / GiB:.1f} GiB > capacity {capacity / GiB:.1f} GiB"))
                        continue
                    any_fit = True
                    st = timing.step_time(cfg, chosen, hw, opts, stage)
                    result.evaluated += 1
                    mfu = fpt * tokens / (st.step * opts.devices * hw.peak_flops)
                    result.ranked.append(Candidate(sizes_t, v, b, chosen.zero_stage, remat, mfu, st.step,
                                                   rep.total, ""))
            if not any_fit and opts.tune_microbatches:
                # Activations grow with the microbatch: no larger one can fit either.
                larger = [x for x in mbs if x > b]
                if larger:
                    result.rejected.append(Candidate(
                        sizes_t, 0, larger[0], 0, "", 0.0, 0.0, 0.0,
                        f"out of memory: microbatch sizes {', '.join(map(str, larger))} (larger than {b}, "
                        "which fits under no remat policy)"))
                break
    return result
