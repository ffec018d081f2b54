"""Where workers' output goes (msjax.launch.output): all of it to each rank's log file, byte for byte; to the
terminal, rank 0's lines and every rank's warnings and errors with `[rank R] `; jax's C++ abort of a worker whose
peer died (glog lines, a fatal line, a stack) as one line. Real output shapes: an absl fatal as jax 0.10 prints it
when the coordination service is gone, a Python traceback, a warnings-module warning, tqdm's carriage returns."""

import io

from msjax.launch.output import LOST_SERVICE_LINE, Router, lost_distributed_service

ABORT = (
    b"W1125 14:10:44.539834   31372 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from "
    b"coordination service: UNAVAILABLE: Socket closed\n"
    b"E1125 14:10:44.540276   31372 coordination_service_agent.cc:289] Polled an error from coordination service "
    b"(this can be an error from this or another task).\n"
    b"F1125 14:10:44.540379   31372 client.h:80] Terminating process because the JAX distributed service detected "
    b"fatal errors. This most likely indicates that another task died\n"
    b"*** Check failure stack trace: ***\n"
    b"    @     0x7fb209c40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()\n"
    b"    @     0x7fb205d040ee  xla::CoordinationServiceAgent::SetError()\n")


def _route(tmp_path, rank: int, data: bytes, chunk: int = 7) -> tuple[str, bytes]:
    """`data` through a Router as rank `rank`, fed in `chunk`-byte pieces (lines split across reads)."""
    out = io.StringIO()
    stream = io.BytesIO(data)

    class Chunks:  # a pipe delivers what was written so far, not whole lines
        def read1(self, n):
            return stream.read(chunk)

    Router(out).pump(rank, Chunks(), tmp_path / f"rank{rank}.log").join(10)
    return out.getvalue(), (tmp_path / f"rank{rank}.log").read_bytes()


def test_other_ranks_show_only_warnings_and_errors_and_every_byte_is_logged(tmp_path):
    data = (b"msjax.control: rank 1 of 2\nstep 5: val loss 3.1\nwarning: token cache rebuilt\n"
            b"/x/corpus.py:251: UserWarning: skipping a.txt: not valid UTF-8\n  warnings.warn(\n"
            b"Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    f()\nValueError: bad\n"
            b"after\nerror: the checkpoint of step 8 could not be written\n"
            b"msjax: rank 1 stopping: rank 0 (host0) failed: exit: killed by SIGKILL\n")
    shown, logged = _route(tmp_path, 1, data)
    assert logged == data
    assert shown.splitlines() == [
        "[rank 1] warning: token cache rebuilt",
        "[rank 1] /x/corpus.py:251: UserWarning: skipping a.txt: not valid UTF-8", "[rank 1]   warnings.warn(",
        "[rank 1] Traceback (most recent call last):", '[rank 1]   File "x.py", line 1, in <module>',
        "[rank 1]     f()", "[rank 1] ValueError: bad",
        "[rank 1] error: the checkpoint of step 8 could not be written",
        "[rank 1] msjax: rank 1 stopping: rank 0 (host0) failed: exit: killed by SIGKILL"]


def test_rank_0_shows_everything_and_its_progress_bar_updates_in_place(tmp_path):
    shown, _ = _route(tmp_path, 0, b"msjax: gpt_tiny\ngpt_tiny:  10%|#  | 1/10\rgpt_tiny:  20%|## | 2/10\rdone\n")
    assert shown == ("[rank 0] msjax: gpt_tiny\n[rank 0] gpt_tiny:  10%|#  | 1/10\r[rank 0] gpt_tiny:  20%|## | 2/10\r"
                     "[rank 0] done\n")


def test_a_worker_aborted_because_a_peer_died_is_one_line(tmp_path):
    for rank in (0, 1):
        shown, logged = _route(tmp_path, rank, b"step 4\n" + ABORT)
        assert logged.endswith(ABORT)  # the stack stays in the log file
        # the glog lines leading up to the abort, its fatal line and its stack: one line (rank 0's progress stays)
        assert shown.splitlines() == ["[rank 0] step 4"] * (rank == 0) + [f"[rank {rank}] {LOST_SERVICE_LINE}"]
    assert lost_distributed_service(ABORT.decode()) and not lost_distributed_service("step 4\nerror: disk full\n")
    # a worker's own SIGTERM notice from jax's preemption notifier is no peer's death
    shown, _ = _route(tmp_path, 1, b"W1125 14:11:07.960591   31752 preemption_notifier.cc:90] SIGTERM caught\n")
    assert "lost the JAX" not in shown and "SIGTERM caught" in shown


def test_labelled_step_output_is_split_per_task(tmp_path):
    """An `srun --label` step: each task's lines to its own log and the terminal, the launcher's bookkeeping
    lines (MSJAX_TASK) only to the step's log and its callback."""
    out, seen = io.StringIO(), []
    data = b"0: MSJAX_TASK start 0 n1 7 1\n0: step 1\n1: quiet\n 1: error: boom\n0: MSJAX_TASK exit 0 0\n"
    Router(out).pump_labelled(io.BytesIO(data), tmp_path / "step.log", lambda r: tmp_path / f"t{r}.log",
                              seen.append).join(10)
    assert (tmp_path / "step.log").read_bytes() == data and len(seen) == 5
    assert (tmp_path / "t0.log").read_text() == "step 1\n"
    assert (tmp_path / "t1.log").read_text() == "quiet\nerror: boom\n"
    assert out.getvalue() == "[rank 0] step 1\n[rank 1] error: boom\n"


def test_msjax_output_shows_an_unsupervised_slurm_step_as_a_supervised_run(tmp_path):
    """`msjax-output` (what an unsupervised SLURM job pipes its worker step into), run as its own process on a
    labelled stream: per-rank logs, `[rank R] ` lines for rank 0's output and other ranks' alerts, srun's own
    unlabelled error line shown as it is, the wrapper's bookkeeping lines only in the step log, and a SIGTERM
    (a preemption reaches every process of the job) does not cut the stream short."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "msjax.launch.output", f"--log_dir={tmp_path / 'logs'}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(b"0: MSJAX_TASK start 0 n1 7 1\n1: MSJAX_TASK start 1 n2 7 1\n0: step 1\n1: step 1\n")
    proc.stdin.flush()
    first = proc.stdout.readline()  # it is reading (its signal dispositions were set before)
    proc.send_signal(signal.SIGTERM)
    tail = (b"1: msjax: rank 1: SIGTERM received: every process finishes the same step, saves, then exits\n"
            b"1: warning: slow disk\nsrun: error: n2: task 1: Exited with exit code 143\n0: stopping after step 2\n")
    out, err = proc.communicate(tail, timeout=60)
    assert proc.returncode == 0, err
    assert (first + out).decode() == ("[rank 0] step 1\n[rank 1] warning: slow disk\n"
                            "srun: error: n2: task 1: Exited with exit code 143\n[rank 0] stopping after step 2\n")
    logs = tmp_path / "logs"
    assert (logs / "rank0.log").read_text() == "step 1\nstopping after step 2\n"
    assert (logs / "rank1.log").read_text().splitlines() == ["step 1", "msjax: rank 1: SIGTERM received: every "
                                                             "process finishes the same step, saves, then exits",
                                                             "warning: slow disk"]
    assert (logs / "step.log").read_text().count("MSJAX_TASK") == 2
