"""The training loop: data in, metrics, checkpoints and a sample out.

`run(config)` is the whole job: prepare data (tokenize once, cached), build the mesh and the sharded train
program, restore or initialise the state, then step with a progress bar (loss, tokens/s, MFU), evaluate every
`train.eval_every` steps, checkpoint every `checkpoint.every` steps and at the end, and print a sample.

`main(argv)` is the train command (`msjax-train`, `python -m msjax.train`, scripts/train.py; see its docstring
for the flags and exit statuses): every launcher starts its workers this way.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

import jax
import numpy as np
from tqdm import tqdm

from msjax.checkpoint import (Checkpointer, NoWholeCheckpointError, check_resume_config, checkpoint_dir,
                              ensure_writable, local_checkpoint_dir)
from msjax import distributed, paths, runtime
from msjax.config import Config, ConfigError, to_dict
from msjax.data import BatchLoader, check_data_paths, eval_batches, prepare_chat_data, prepare_data
from msjax.faults import NonFiniteStop, StopOnSignal
from msjax.hooks import Hook, Hooks, LoopControl, RunContext
from msjax.layout import resolve as resolve_layout
from msjax.metrics import MetricsWriter
from msjax.observe import MetricsSink, loop_hooks
from msjax.control import phases
from msjax.parallel import xla_flags
from msjax.generate import Generator
from msjax.goodput import LoopLedger
from msjax.log import ensure_visible
from msjax.train_step import TrainProgram, build_train_program


if TYPE_CHECKING:
    from msjax.control.hook import ControlPlaneHook

log = logging.getLogger(__name__)


def _log(msg: str) -> None:
    # One channel: logging (msjax.log); the other processes' copies of rank 0's lines would only repeat them.
    if jax.process_index() == 0:
        log.info(msg)


def build_hooks(cfg: Config, control_plane: "ControlPlaneHook | None" = None, sinks: Sequence[MetricsSink] = (),
                extra: Sequence[Hook] = ()) -> list[Hook]:
    """The run's hooks, in the order the loop calls them (`on_end` in reverse), from its config: the metrics
    writer (`msjax.metrics.MetricsWriter`, per `train.loggers`: its sinks open before every other hook starts and
    close after every other hook ended), fault handling (`StopOnSignal`; `NonFiniteStop` with
    train.nonfinite=stop), observability (`msjax.observe.loop_hooks`: the step observer and the profiler, per the
    `observe` section, and a mixture of experts' load), the control plane, `extra`, and last the goodput ledger
    (`msjax.goodput.LoopLedger`: its clock starts once every other hook has started and stops before any other
    ends).

    What hooks share is passed here, explicitly: the step observer publishes to `sinks` and, when the run joined a
    control plane, to its metrics sink, and records straggler exclusions through it.

    Args:
      cfg: the run's config.
      control_plane: the process's `msjax.control.hook.ControlPlaneHook`, or None outside a control plane.
      sinks: further live metric sinks for the step observer (`msjax.observe.MetricsSink`).
      extra: the caller's own hooks, called last.
    """
    fault_hooks = [StopOnSignal(), *([NonFiniteStop()] if cfg.train.nonfinite == "stop" else [])]
    sinks, exclude_host, plane = list(sinks), None, []
    if control_plane is not None:
        sinks.append(control_plane.metrics)
        exclude_host, plane = control_plane.metrics.exclude_host, [control_plane]
    return [MetricsWriter(cfg.train.loggers), *fault_hooks, *loop_hooks(cfg, sinks=sinks, exclude_host=exclude_host),
            *plane, *extra, LoopLedger(sinks=sinks)]


@dataclass
class RunSummary:
    """What `run` returns.

    Attributes:
      start_step: the step the run started from (0, or the restored checkpoint's).
      final_step: the last step taken.
      val_loss: (step, mean validation loss in nats per token) at every evaluation.
      train_loss: the loss of the last logged step (None when no step was logged).
      tokens_per_s, mfu: throughput and model FLOPs utilisation of the last logging interval (None before one).
      wall_s: seconds from the call to the end of the loop (sample excluded).
      first_step_s: seconds to the end of the first step (compilation included); None when no step ran.
      checkpoints: the steps with a checkpoint on disk at the end.
      param_count: parameters (elements).
      goodput: the run's goodput ledger (`msjax.goodput.LoopLedger.finish`).
      sample: text generated at the end (None when disabled or stopped).
      stop_reason, stop_signal: why the loop stopped early and the signal behind it (None when it finished).
      state: the final train state (`msjax.train_step`), left out of `to_json`.
    """

    # In the order the train command has always printed them (its JSON line starts with the validation losses).
    val_loss: list[tuple[int, float]] = field(default_factory=list)
    start_step: int = 0
    tokens_per_s: float | None = None
    mfu: float | None = None
    stop_reason: str | None = None
    stop_signal: int | None = None
    final_step: int = 0
    train_loss: float | None = None
    wall_s: float = 0.0
    first_step_s: float | None = None
    checkpoints: list[int] = field(default_factory=list)
    param_count: int = 0
    sample: str | None = None
    goodput: dict[str, Any] = field(default_factory=dict)
    state: Any = None



# Present in the JSON only when the run produced them (a stopped run has no sample, a run that never logged no
# throughput), as the train command has always printed it.
_ONLY_WHEN_SET = ("tokens_per_s", "mfu", "sample", "stop_reason", "stop_signal")


def _restore(ckpt: Checkpointer, program: TrainProgram) -> tuple[int, Any, dict | None]:
    """(step, train state, loader state) of the newest verified checkpoint. One without optimizer state (an imported
    model's: `convert.py --from_hf` writes the parameters only) is read partially, and gets the optimizer state a
    new run makes (`optimizer.init`, AdamW's zero moments) on the mesh, and no loader state (its data stream starts
    afresh)."""
    held = ckpt.newest_holds()
    if not held or "opt_state" in held:
        return ckpt.restore(program.abstract_state)
    part = {key: program.abstract_state[key] for key in ("step", "params", "rng")}
    step, state, _ = ckpt.restore(part, partial=True)
    init = jax.jit(program.optimizer.init, out_shardings=program.state_shardings["opt_state"])
    return step, {**state, "opt_state": init(state["params"])}, None


def _describe_data(data) -> str:
    """The start-up line's account of the data: token counts of a corpus, or of packed chat examples."""
    if isinstance(data.train, np.ndarray):
        return f"train {len(data.train):,} / val {len(data.val):,} tokens"
    tr, va = data.train, data.val
    used = tr.num_tokens / tr.arrays["inputs"].size
    return (f"chat: train {tr.num_examples:,} examples in {tr.num_rows:,} rows ({tr.num_tokens:,} tokens, "
            f"{tr.num_loss_tokens:,} trained on; {used:.0%} of the rows' slots) / val {va.num_examples:,} examples")


def summary_json(summary: RunSummary) -> dict[str, Any]:
    """The JSON-friendly fields of `run`'s summary (no state), as the train command prints them."""
    out = {f.name: getattr(summary, f.name) for f in fields(summary) if f.name != "state"}
    return {k: v for k, v in out.items() if not (k in _ONLY_WHEN_SET and v is None)}


def run(cfg: Config, hooks: Sequence[Hook] = (), control: LoopControl | None = None,
        control_plane: "ControlPlaneHook | None" = None, sinks: Sequence[MetricsSink] = (),
        preflight: Callable[[Config], Config] | None = None) -> RunSummary:
    """Trains `cfg` and returns a `RunSummary`: final train/val loss, tokens/s, MFU, step and wall times.

    Args:
      cfg: the run's config.
      hooks: the caller's own hooks (`msjax.hooks`), called after the run's own (`build_hooks`).
      control: requests to the loop (stop, checkpoint now, profile); a fresh LoopControl by default.
      control_plane: the process's control-plane hook, when it joined one (`build_hooks`).
      sinks: further live metric sinks for the step observer (`build_hooks`).
      preflight: called with the validated config before its layout is resolved, any data read, directory
        written or program compiled, to refuse a run that cannot fit on the devices (scripts/train.py passes the
        planner's check, `msjax.planner.preflight.check_layout`: mesh, split and memory estimate, with overrides
        that would fit); it raises ConfigError, or returns the config to run (the planner's may raise a preset's
        remat policy to the cheapest that fits).

    Raises:
      ConfigError: a config that does not fit the devices or data (mesh size, model and batch split, the
        preflight's memory estimate, vocabulary; all but the vocabulary checked before anything is read or
        allocated), a path msjax cannot use
        (msjax.paths.PathError: an unknown scheme, a missing backend package, a URL for a local-only key), an
        unwritable checkpoint directory,
        checkpoints already present without `checkpoint.resume`, or a resume whose config differs from the
        checkpoint's in a key that must match (checked before anything is written).
      msjax.data.DataError: missing, empty or undecodable data.
      msjax.checkpoint.CheckpointError: a checkpoint write failed (raised within a step of the failure), or no
        checkpoint passes verification on resume.
      msjax.faults.NonFiniteLossError: a non-finite loss with `train.nonfinite=stop`.
    """
    t_start = time.perf_counter()
    runtime.setup()  # once per process; an entry point has usually done it already (msjax.runtime)
    ensure_visible()  # a caller that configured no logging (a notebook) still sees the loop's messages
    cfg = cfg.validate()
    t = cfg.train
    # Every path key, before anything is read or written: a scheme msjax does not serve, a missing backend
    # package or a URL for a local-only key is one PathError naming the key.
    paths.configure(cfg.storage)
    run_dir = paths.local(t.run_dir, "train.run_dir")
    check_data_paths(cfg.data)
    ckpt_dir = checkpoint_dir(cfg.checkpoint, t.run_dir)
    local_ckpt_dir = local_checkpoint_dir(cfg.checkpoint)
    if preflight is not None:
        cfg = preflight(cfg).validate()
    layout = resolve_layout(cfg)  # mesh and divisibility, before any data, directory or compilation
    if jax.process_index() == 0:
        ensure_writable(run_dir, "train.run_dir")
    ckpt = Checkpointer(cfg.checkpoint, ckpt_dir)
    latest = ckpt.job_latest_step()  # the job's: a new host's local tier is empty
    if latest is not None and not cfg.checkpoint.resume:
        raise ConfigError(f"{ckpt.directory} already holds checkpoints (latest step {latest}); pass --resume to "
                          "continue from it, or set checkpoint.dir / train.run_dir to start a new run")
    if latest is not None:
        record = ckpt.newest_record()
        saved_cfg, where = (record or {}).get("config"), f"step {latest} in {ckpt.directory}"
        if saved_cfg is None and (run_dir / "config.json").exists():
            saved_cfg, where = json.loads((run_dir / "config.json").read_text()), str(run_dir / "config.json")
        check_resume_config(saved_cfg, cfg, where, step=latest)

    # Chat (supervised fine-tuning): conversations rendered, masked and packed into rows (msjax.data.sft).
    data = prepare_chat_data(cfg.data, t.seq_len) if cfg.data.format == "chat" else prepare_data(cfg.data)
    layout = layout.with_vocab(data.tokenizer.vocab_size)
    program = build_train_program(layout)
    cfg, mesh = layout.config, layout.mesh
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        data.tokenizer.save(str(run_dir / "tokenizer.json"))
        ckpt.keep_beside([run_dir / "config.json", run_dir / "tokenizer.json"])
    phases.mark("prepared")

    loader_state = None
    if latest is not None:
        try:
            start_step, state, loader_state = _restore(ckpt, program)
            _log(f"resumed from step {start_step} ({ckpt.directory}"
                 + ("; read by one data-parallel replica, broadcast to the others)" if ckpt.replica_restore else ")"))
        except NoWholeCheckpointError as e:  # lost with a host: nothing damaged, nothing to resume from
            logging.getLogger(__name__).warning("%s; starting from step 0", e)
            latest = None
    if latest is None:
        if cfg.checkpoint.resume:
            _log(f"--resume: no checkpoint in {ckpt.directory}; starting from step 0")
        start_step, state = 0, program.init_fn(jax.random.key(t.seed))
    phases.mark("restored")  # (the supervisor's recovery breakdown: msjax.control.phases)
    ckpt.prepare(state)  # the checksum programs compile beside the first step's
    loader = BatchLoader(data.train, seq_len=t.seq_len, global_batch=t.global_batch, seed=cfg.data.seed,
                         sharding=program.batch_sharding, prefetch=cfg.data.prefetch)
    if loader_state is not None:
        loader.restore(loader_state)
    val = eval_batches(data.val, seq_len=t.seq_len, batch=t.global_batch, num_batches=t.eval_batches,
                       seed=cfg.data.seed + 1, sharding=program.batch_sharding)

    peak, peak_label = layout.peak
    tokens_per_step = layout.tokens_per_step
    _log(f"msjax: {cfg.name} | {program.param_count / 1e6:.2f}M params | mesh "
         f"{dict(mesh.shape)} | {layout.num_devices} x {jax.devices()[0].device_kind} | MFU against "
         f"{peak / 1e12:.3g} TFLOP/s ({peak_label}) | {_describe_data(data)}")
    if program.pipeline is not None:
        _log(program.pipeline.describe())
    _log(xla_flags.describe())

    # Once: the checkpoint record holds it, and converting the config each step cost ~0.6 ms of host CPU per step
    # (the 2-core CPU recipe runs the loop's host work on the cores its steps compute on).
    cfg_dict = to_dict(cfg)
    lrs = program.learning_rates  # lr of step s at s - 1, logged with the loss
    control = control or LoopControl()
    hook_list = build_hooks(cfg, control_plane, sinks, extra=hooks)
    goodput = next(h for h in hook_list if isinstance(h, LoopLedger))
    hook = Hooks(hook_list)
    ctx = RunContext(config=cfg, run_dir=run_dir, mesh=mesh, program=program, start_step=start_step,
                     control=control, checkpoint_dir=ckpt_dir,
                     local_checkpoint_dir=local_ckpt_dir)
    hook.on_start(ctx)
    # With train.steps_per_execution K > 1 one call runs K steps (program.steps_fn), unless a step the loop acts on
    # (a log, evaluation, save, observer window or GC step; the last step) falls inside them: single steps up to it.
    k = t.steps_per_execution
    intervals = [i for i in (t.log_every, t.eval_every, cfg.checkpoint.every, cfg.observe.window,
                             cfg.observe.gc_every) if i]

    def steps_of_call(done: int) -> int:
        end = done + k
        if k == 1 or end > t.steps or any((done // i + 1) * i < end for i in intervals):
            return 1
        return k

    batch_spec = program.abstract_batch
    if steps_of_call(start_step) > 1:
        distributed.align_first_step(program.steps_fn, state, (batch_spec,) * k)
    else:
        distributed.align_first_step(program.step_fn, state, batch_spec)
    summary = RunSummary(start_step=start_step)
    bar = tqdm(total=t.steps, initial=start_step, disable=not t.progress or jax.process_index() != 0,
               dynamic_ncols=True, desc=cfg.name)
    last_log_step, last_log_time, first_step_time = start_step, None, None
    step = start_step
    loss = float("nan")
    error: BaseException | None = None
    try:
        while step < t.steps:
            n = steps_of_call(step)
            t_fetch = time.perf_counter()
            batches = tuple(next(loader) for _ in range(n))
            ctx.timings["issue_t"] = t_issue = time.perf_counter()
            if n == 1:
                state, metrics = program.step_fn(state, batches[0])
            else:
                state, metrics = program.steps_fn(state, batches)
            step += n  # the step the call ends at: what the hooks, logging, evaluation and saves below see
            ctx.timings.update(data_s=t_issue - t_fetch, dispatch_s=time.perf_counter() - t_issue, steps=n)
            bar.update(n)
            ckpt.poll(step)  # a failed checkpoint write stops the run here, within a step of the failure
            hook.on_step_end(ctx, step, metrics)
            if last_log_time is None:  # the first step includes compilation: time from its end
                jax.block_until_ready(metrics)
                last_log_time, last_log_step = time.perf_counter(), step
                first_step_time = last_log_time - t_start
            elif (t.log_every and step % t.log_every == 0) or step == t.steps:
                loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
                now = time.perf_counter()
                tok_s = (step - last_log_step) * tokens_per_step / (now - last_log_time)
                mfu = layout.mfu(tok_s / tokens_per_step)
                last_log_step, last_log_time = step, now
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", mfu=f"{mfu:.1%}")
                scalars = {"loss": loss, "grad_norm": grad_norm, "lr": float(lrs[step - 1]), "tokens_per_s": tok_s,
                           "mfu": mfu, "skipped": int(metrics["skipped"]),
                           # a mixture of experts' router losses and load (`train_step.loss_fn`)
                           **{k: float(v) for k, v in metrics.items() if k.startswith("moe_")}}
                hook.on_log(ctx, step, scalars)
                summary.tokens_per_s, summary.mfu = tok_s, mfu
            t_eval = time.perf_counter()
            if val and ((t.eval_every and step % t.eval_every == 0) or step == t.steps):
                val_loss = program.evaluate(state["params"], val)
                summary.val_loss.append((step, val_loss))
                hook.on_eval(ctx, step, {"val_loss": val_loss, "wall_s": time.perf_counter() - t_start})
                _log(f"step {step}: val loss {val_loss:.4f} ({time.perf_counter() - t_start:.1f} s)")
            ctx.timings["eval_s"] = time.perf_counter() - t_eval
            if ckpt.reached_preemption(step):  # multi-process: all processes stop at the same step
                # jax's preemption service is set off by SIGTERM; every process stops after this same step
                control.request_stop("preemption notice (SIGTERM; jax preemption sync point)", signal=signal.SIGTERM)
            stopping = control.stop_reason is not None
            # Orbax decides the periodic saves; these are the ones the loop was asked for.
            force = step == t.steps or stopping or control.take_checkpoint_request()
            t_save = time.perf_counter()
            saved = ckpt.save(step, state, loader.state(), force=force, config=cfg_dict)
            ctx.timings["checkpoint_s"] = time.perf_counter() - t_save
            if saved:
                hook.on_checkpoint(ctx, step)
            if stopping:
                ckpt.wait()  # the stop's checkpoint is complete (recorded, copied) before the loop returns
                _log(f"stopping after step {step}: {control.stop_reason}; checkpoint of step {step} complete")
                summary.stop_reason, summary.stop_signal = control.stop_reason, control.stop_signal
                break
    except BaseException as e:
        error = e
        raise
    finally:
        hook.on_end(ctx, error)
        bar.close()
        loader.close()
        t_close = time.perf_counter()
        ckpt.close()  # waits for an asynchronous save to commit: checkpoint time in the goodput ledger
        ckpt_close_s = time.perf_counter() - t_close

    summary.final_step, summary.train_loss = step, loss if not math.isnan(loss) else None
    summary.wall_s, summary.first_step_s = time.perf_counter() - t_start, first_step_time
    summary.checkpoints, summary.param_count = ckpt.all_steps(), program.param_count
    # Every process takes part (the parameters are sharded over all of them); a stopped run exits without one.
    if t.sample_tokens and summary.stop_reason is None:
        tok = data.tokenizer
        prompt = [tok.eot_id] if tok.eot_id is not None else tok.encode("\n").tolist()
        key = jax.random.wrap_key_data(state["rng"])
        # KV-cached decoding on the training mesh; past model.max_seq_len the context rolls (msjax.generate).
        generator = Generator(cfg.model, program.graphdef, state["params"], mesh, layout.rules)
        ids = generator.generate([prompt], t.sample_tokens, temperature=t.sample_temperature, seed=key,
                                 rolling=True)[0]
        summary.sample = tok.decode(ids)
        _log("---- sample ----\n" + summary.sample + "\n----------------")
    # every rank's ledger is in goodput.json; the summary (printed, returned) keeps the job's figures
    summary.goodput = {k: v for k, v in goodput.finish(ckpt_close_s).items() if k != "ranks"}
    summary.state = state
    return summary



def _multiprocess(hook) -> bool:
    return hook is not None and jax.process_count() > 1


def _peer_failure(hook) -> str | None:
    """`hook.peer_failure()` (None without a hook), with SIGTERM held off while it waits: a supervisor asks the
    survivors of a failed job to leave (the request this waits for, read within 0.1 s) and sends SIGTERM right
    after it; the loop has put the default handler back, so dying of that signal would lose the one line that says
    why this process stopped."""
    if hook is None:
        return None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        return hook.peer_failure()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _leave_for_peer(peer: str, error: BaseException) -> NoReturn:
    """Ends a worker that failed because a peer did: one line naming the peer's failure and this process's error,
    then exit EXIT_REQUESTED at once (jax.distributed's exit handler would wait at a shutdown barrier for the dead
    peer)."""
    import os
    import sys

    from msjax.control.store import EXIT_REQUESTED

    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    print(f"msjax: rank {jax.process_index()} stopping: {peer} ({type(error).__name__}: {first})", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_REQUESTED)


def main(argv: Sequence[str] | None = None, preflight: Callable[[Config], Config] | None = None) -> int:
    """The train command: `msjax-train --config=gpt_tiny [--train.steps=200 --mesh.tensor=2 ... --resume]` (also
    `python -m msjax.train` and scripts/train.py). Flags -> config -> `run`; every field of msjax/config.py is a
    dotted flag (`--help` lists them), presets live in configs/. Under a launcher (MSJAX_REDIS_URL set) it
    joins the run's control plane first (msjax.control.worker) and runs with its hook. `preflight` goes to `run`:
    `msjax-train` and scripts/train.py (`msjax.launch.cli.train`) pass the planner's memory check;
    `python -m msjax.train`, the loop's own module, checks mesh and split only (a launcher has run the memory
    check for its workers before starting them).

    Returns the exit status:
      0    finished: the loop reached train.steps.
      1    the run failed (a checkpoint write, a non-finite loss with train.nonfinite=stop, any other error).
      2    bad flags, config or data, or a control plane that cannot be joined: nothing was trained.
      75   stopped early and resumable, not by a signal: a stop command, asked to leave because a peer failed or
           the job is being restarted, or failed because a peer died (a collective, a save's included, that the
           dead peer never joined) (msjax.control.store.EXIT_REQUESTED; the reason is one line on stderr).
      128 + N  stopped by signal N (130 SIGINT, 143 SIGTERM; received, or relayed by a launcher as a stop
           command) after saving a complete checkpoint: resumable with --resume, never taken for finished.
    """
    import os
    import sys
    import traceback

    from msjax import cli

    runtime.setup()  # first: malloc before jax allocates, XLA_FLAGS before its backend starts (msjax.runtime)
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--profile_steps=K:N` (or `--profile_steps K:N`) is short for `--observe.profile_steps=K:N`.
    argv = ["--observe." + a[2:] if a.split("=")[0] == "--profile_steps" else a for a in argv]

    def body() -> int:
        cfg, (common,) = cli.parse(argv, prog="msjax-train", description=main.__doc__)
        cli.setup_logging(common)
        from tqdm.contrib.logging import logging_redirect_tqdm

        from msjax.checkpoint import CheckpointError
        from msjax.control import ControlError
        from msjax.control.store import EXIT_REQUESTED
        from msjax.faults import NonFiniteLossError

        phases.mark("imports")
        xla_flags.apply(cfg.mesh.tp_overlap)  # before the backend starts: XLA reads XLA_FLAGS once
        hook = None
        try:
            if os.environ.get("MSJAX_REDIS_URL"):  # a launcher's worker: rendezvous, then jax.distributed
                from msjax.checkpoint import latest_verified
                from msjax.control.hook import ControlPlaneHook
                from msjax.control.worker import join_from_env

                s = cfg.supervisor
                hook = ControlPlaneHook(join_from_env(), s.heartbeat_period_s, s.heartbeat_timeout_s,
                                        newest_checkpoint=latest_verified)
            else:
                distributed.initialize()
                phases.mark("distributed")
            with logging_redirect_tqdm():  # log records go around the progress bar, not through it
                summary = summary_json(run(cfg, control_plane=hook, preflight=preflight))
        except ControlError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except (CheckpointError, NonFiniteLossError) as e:  # the run stopped; the newest verified checkpoint is kept
            # A save's collectives fail when a peer dies mid-save: that is the peer's failure, not this one's.
            peer = _peer_failure(hook) if isinstance(e, CheckpointError) and _multiprocess(hook) else None
            if peer:
                _leave_for_peer(peer, e)
            print(f"error: {e}", file=sys.stderr)
            return 1
        except BaseException as e:
            if jax.process_count() == 1:
                raise
            # jax.distributed's exit handler would wait at a shutdown barrier for every process while the others
            # wait in a collective for this one: end now, so the launcher or supervisor sees it. A process that
            # failed because a peer died says so in one line (the control plane knows: the launcher asked it to
            # leave, or the peer's heartbeat is gone); its own failure prints the traceback.
            peer = _peer_failure(hook)
            if peer:
                _leave_for_peer(peer, e)
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        summary.pop("sample", None)
        if jax.process_index() == 0:
            print(json.dumps(summary))
        if summary.get("stop_reason") and summary["final_step"] < cfg.train.steps:
            return 128 + summary["stop_signal"] if summary.get("stop_signal") else EXIT_REQUESTED
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    import sys

    sys.exit(main())
