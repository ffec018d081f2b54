"""kill -9 inside a save, and rotation after damaged and unfinished checkpoints.

Each kill trial starts a process that saves a small state in a loop (scripts/bench_checkpoint.py's SAVER), sees
the unfinished directory of one of its saves (Orbax's temporary directory while the files are written; the
committed step directory before its integrity record; the step's prefix in a bucket on a real S3 server before
its record object), and only then sends SIGKILL. A trial counts when the step it saw has no record after the kill
(the kill landed inside that save); at least 20 such trials run. In every trial `latest_verified` names the step
before the killed one, the restore resumes from exactly that step with the state saved there bit for bit, and the
unfinished step is never restored (and is gone afterwards).
"""

import importlib.util
import shutil
import sys
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

from msjax import paths
from msjax.checkpoint import Checkpointer, latest_verified
from msjax.checkpoint.integrity import RECORD_NAME
from msjax.config import CheckpointConfig
from tests.msjax.object_store import S3Server

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SIZE = 1 << 18  # float32 values in the saved array: a 1 MiB state, a save of tens of milliseconds here
LANDED_TRIALS = 20


def _bench():
    """scripts/bench_checkpoint.py imported as a module, for its saver and its kill (not its verification)."""
    spec = importlib.util.spec_from_file_location("bench_checkpoint", SCRIPTS / "bench_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _expected(step: int) -> dict:
    """What the saver saved at `step`, computed here (not by the script): w from a generator seeded by the step."""
    return {"step": np.int32(step), "w": np.random.default_rng(step).standard_normal(SIZE, dtype=np.float32)}


def _abstract():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _expected(1))


def _restore(directory, local) -> tuple[int, dict]:
    c = Checkpointer(CheckpointConfig(timeout_s=120), directory, local)
    try:
        step, state, loader = c.restore(_abstract())
    finally:
        c.close()
    assert loader == {"step": step}
    return step, jax.device_get(state)


def _bit_identical(state: dict, step: int) -> None:
    expected = _expected(step)
    assert sorted(state) == sorted(expected)
    for k in expected:
        np.testing.assert_array_equal(np.asarray(state[k]).reshape(-1).view(np.uint8),
                                      np.asarray(expected[k]).reshape(-1).view(np.uint8))


@pytest.mark.slow
def test_kill_9_inside_a_save_never_restores_it_and_latest_verified_names_the_resume_step(tmp_path):
    bench = _bench()
    landed: Counter = Counter()
    # Each phase until its share of the landed trials: a phase whose window is short under load (the bucket's
    # upload, seen through polled listings) gets more tries instead of being crowded out by the others.
    share = -(-LANDED_TRIALS // len(bench.KILL_PHASES))
    with S3Server() as s3:
        bucket = s3.make_bucket("kill")
        for i in range(4 * LANDED_TRIALS):
            wanting = [p for p in bench.KILL_PHASES if landed[p] < share]
            if not wanting:
                break
            phase = wanting[i % len(wanting)]
            remote = phase == "upload"
            directory = f"{bucket}/{i}" if remote else str(tmp_path / str(i))
            local = tmp_path / f"{i}-local"
            trial = bench.kill_during_save(phase, directory, str(local) if remote else "", s3.endpoint,
                                           s3.storage.s3_region, SIZE, min_step=2 + i % 3)
            # A new machine for the bucket: an empty local tier, so the restore must read the bucket.
            fresh = tmp_path / f"{i}-fresh" if remote else None
            answer = latest_verified(directory, fresh)
            step, state = _restore(directory, fresh)
            assert step == answer, (trial, step, answer)  # every trial, landed or not
            _bit_identical(state, step)
            if not trial.landed:  # the save completed between the look and the kill: proves nothing; not counted
                continue
            landed[phase] += 1
            # The unfinished save was seen before the kill and had no record after it; the step before it (complete
            # before this save began: a save waits for the previous one's record and copy) is what resumes.
            assert step == trial.step - 1, trial
            assert str(trial.step) not in paths.listdir(directory)  # the interrupted write was deleted
            if remote:
                # The machine that was killed still has the step complete in its local tier (its record was
                # written before the upload began): it resumes from there, also bit-identical.
                assert latest_verified(directory, local) == trial.step
                step, state = _restore(directory, local)
                assert step == trial.step
                _bit_identical(state, step)
    assert all(landed[p] == share for p in bench.KILL_PHASES), landed  # 7 per phase: 21 >= LANDED_TRIALS


def _save(ckpt: Checkpointer, step: int) -> None:
    ckpt.save(step, jax.tree.map(jax.numpy.asarray, _expected(step)), {"step": step}, force=True)
    ckpt.wait()


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _recorded(directory: Path) -> list[int]:
    return [s for s in _steps(directory) if (directory / str(s) / RECORD_NAME).exists()]


def _flip_data_bit(step_dir: Path) -> None:
    """One bit in the middle of the checkpoint's largest data file (the saved array's compressed chunk)."""
    biggest = max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x04
    biggest.write_bytes(bytes(data))


@pytest.mark.parametrize("keep", [1, 2])
def test_rotation_never_deletes_the_newest_verified_checkpoint(tmp_path, keep):
    """keep=k. A killed run left step 3 unfinished (no record) over complete ones; step 2 is then damaged. The
    restore deletes 3, rejects 2 and resumes from 1 (keep=2) or finds nothing (keep=1: rotation had already removed
    1 when 2 was complete; that is what keep=1 means). Then, save after save, rotation keeps the newest k recorded
    checkpoints and never touches a newer step without a record (a write in flight), and the newest verified one
    is always the one just completed."""
    d = tmp_path / "ckpt"
    cfg = CheckpointConfig(every=0, keep=keep, async_save=True, timeout_s=60)
    ckpt = Checkpointer(cfg, d)
    for step in (1, 2):
        _save(ckpt, step)
    ckpt.close()
    assert _recorded(d) == [1, 2][-keep:]
    # What a kill between Orbax's commit and the record leaves: step 3's files without a record.
    (d / "3").mkdir()
    for f in (d / "2").iterdir():
        if f.name != RECORD_NAME:
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, d / "3" / f.name)
    _flip_data_bit(d / "2")
    assert latest_verified(d) == 2  # recorded; only reading it finds the damage
    ckpt = Checkpointer(cfg, d)
    if keep == 1:
        with pytest.raises(Exception, match="no checkpoint passes verification"):
            ckpt.restore(_abstract())
        start = 0
    else:
        start, state, _ = ckpt.restore(_abstract())
        assert start == 1
        _bit_identical(jax.device_get(state), 1)
    assert 3 not in _steps(d) and len(list((d / "rejected").iterdir())) == 1
    # A write in flight: a newer step directory without a record must survive every rotation below.
    in_flight = d / "99"
    in_flight.mkdir()
    (in_flight / "partial").write_bytes(b"x")
    for step in range(start + 1, start + 4):
        _save(ckpt, step)
        assert _recorded(d)[-1] == step == latest_verified(d)
        assert _recorded(d) == list(range(max(1, step - keep + 1), step + 1))
        assert in_flight.is_dir()
    ckpt.close()


@pytest.mark.parametrize("verified_before", [False, True])
def test_an_interrupted_write_is_discarded_when_the_checkpointer_opens(tmp_path, verified_before):
    """A step directory left exactly as a kill -9 between Orbax's commit and the integrity record leaves it (every
    file, no record) is deleted when the next Checkpointer opens, so the restarted run can save that step again
    (left in place, Orbax refuses the save with StepAlreadyExistsError): with no verified checkpoint before it
    (the run starts over from step 0 and reaches the step again) and with one (the run resumes from it). A step
    with a record is never deleted at open, not even one whose record is unreadable (the restore moves that one
    aside)."""
    d = tmp_path / "ckpt"
    cfg = CheckpointConfig(every=0, keep=3, async_save=True, timeout_s=60)
    ckpt = Checkpointer(cfg, d)
    for step in (1, 2, 3):
        _save(ckpt, step)
    ckpt.close()
    (d / "3" / RECORD_NAME).unlink()  # step 3: committed, its record never written
    if verified_before:
        (d / "1" / RECORD_NAME).write_text("{not json")  # damaged, but recorded: kept at open
    else:
        for step in (1, 2):
            shutil.rmtree(d / str(step))
    assert latest_verified(d) == (2 if verified_before else None)
    ckpt = Checkpointer(cfg, d)
    assert _steps(d) == ([1, 2] if verified_before else []) and ckpt.latest_step() == latest_verified(d)
    start = 0
    if verified_before:
        start, state, _ = ckpt.restore(_abstract())
        assert start == 2
        _bit_identical(jax.device_get(state), 2)
    for step in range(start + 1, 4):
        _save(ckpt, step)  # with the interrupted step 3 left in place: StepAlreadyExistsError at step 3
    ckpt.close()
    assert _recorded(d)[-1] == 3 == latest_verified(d)
    assert _restore(d, None)[0] == 3


def test_a_read_only_checkpointer_restores_the_newest_verified_step_and_changes_nothing(tmp_path):
    """A reader of a run that may still be training (generation, export) must not delete a step that sits between
    Orbax's commit and its record, nor move a damaged one aside: it passes over both and restores the newest
    verified step, leaving every directory as it found it."""
    d = tmp_path / "ckpt"
    cfg = CheckpointConfig(every=0, keep=4, async_save=True, timeout_s=60)
    ckpt = Checkpointer(cfg, d)
    for step in (1, 2, 3, 4):
        _save(ckpt, step)
    ckpt.close()
    (d / "4" / RECORD_NAME).unlink()  # step 4: committed, its record not written yet
    _flip_data_bit(d / "3")  # step 3: recorded, but its data no longer matches the checksums
    before = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
    reader = Checkpointer(cfg, d, read_only=True)
    step, state, _ = reader.restore(_abstract())
    reader.close()
    assert step == 2
    _bit_identical(jax.device_get(state), 2)
    assert sorted(str(p.relative_to(d)) for p in d.rglob("*")) == before
