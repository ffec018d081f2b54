"""msjax.hardware's CPU peak: one measurement per process, the best rate a machine has shown kept in msjax's cache
directory, so the MFU denominator of a CPU run does not follow the load of the moment."""

import json

import pytest

from msjax import hardware
from msjax.hardware import CPU_PEAK_FILE, cpu_peak_flops


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A private cache directory and no figure in this process yet; returns the peak file's path."""
    monkeypatch.setenv("MSJAX_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "_cpu_peak", {})
    return tmp_path / "cache" / CPU_PEAK_FILE


def _new_process(monkeypatch, measured: float) -> None:
    """As a new process on the same machine whose measurement gives `measured` FLOP/s."""
    monkeypatch.setattr(hardware, "_cpu_peak", {})
    monkeypatch.setattr(hardware, "measured_cpu_matmul_flops", lambda dtype="float32": measured)


def test_the_first_measurement_is_kept_and_measured_once_per_process(fresh, monkeypatch):
    peak = cpu_peak_flops()  # a real measurement
    assert 1e8 < peak < 1e15
    assert json.loads(fresh.read_text()) == {hardware._cpu_key(): peak}
    monkeypatch.setattr(hardware, "measured_cpu_matmul_flops", lambda dtype="float32": pytest.fail("measured twice"))
    assert cpu_peak_flops() == peak  # the loop's MFU and the observer's use the same figure


def test_a_slower_measurement_keeps_the_best_and_a_faster_one_replaces_it(fresh, monkeypatch):
    key = hardware._cpu_key()
    _new_process(monkeypatch, 2.0e11)
    assert cpu_peak_flops() == 2.0e11
    _new_process(monkeypatch, 1.04e11)  # a loaded moment: the denominator does not drop with it
    assert cpu_peak_flops() == 2.0e11
    assert json.loads(fresh.read_text()) == {key: 2.0e11}
    _new_process(monkeypatch, 2.6e11)
    assert cpu_peak_flops() == 2.6e11
    assert json.loads(fresh.read_text()) == {key: 2.6e11}


def test_other_machines_entries_are_kept_and_a_damaged_file_is_replaced(fresh, monkeypatch):
    fresh.parent.mkdir(parents=True)
    fresh.write_text(json.dumps({"another CPU | 64 cores | jaxlib 0.0": 9e12}))
    _new_process(monkeypatch, 1.5e11)
    assert cpu_peak_flops() == 1.5e11  # another machine's figure is not this one's
    assert json.loads(fresh.read_text()) == {"another CPU | 64 cores | jaxlib 0.0": 9e12, hardware._cpu_key(): 1.5e11}
    for damaged in ("{not json", "[1, 2]", json.dumps({hardware._cpu_key(): "fast"})):
        fresh.write_text(damaged)
        _new_process(monkeypatch, 1.2e11)
        assert cpu_peak_flops() == 1.2e11
        assert json.loads(fresh.read_text())[hardware._cpu_key()] == 1.2e11
    assert not list(fresh.parent.glob(".*.tmp"))


def test_an_unwritable_cache_directory_leaves_the_measurement(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MSJAX_CACHE_HOME", str(blocker / "cache"))  # mkdir fails: a file is in the way
    _new_process(monkeypatch, 1.7e11)
    assert cpu_peak_flops() == 1.7e11


def test_bf16_matmul_peak_is_measured_and_kept_apart_from_float32(fresh):
    """The MFU of a step whose matmuls take bf16 operands (model.matmul_dtype) is against the bf16 rate."""
    import jax

    f32, bf16 = cpu_peak_flops(), cpu_peak_flops("bfloat16")  # real measurements
    assert 1e8 < bf16 < 1e15
    assert json.loads(fresh.read_text()) == {hardware._cpu_key(): f32, hardware._cpu_key("bfloat16"): bf16}
    # the float32 key and the dtype, and whether AMX may be used (a CPU without it has a ~7x lower bf16 rate)
    amx = "" if hardware.cpu_amx_bf16_usable() else " without AMX"
    assert hardware._cpu_key("bfloat16") == hardware._cpu_key() + " | bfloat16" + amx
    peak, label = hardware.mesh_peak_flops(jax.devices("cpu")[:1], "bfloat16")
    assert peak == bf16 and label == "best measured CPU bf16 matmul rate x 1 host(s)"
