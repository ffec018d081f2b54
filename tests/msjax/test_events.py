"""The one event log (msjax.events): its writer API, the schema's own fields, a sink that fails, several writers
at once, and a reader that survives a torn last line (a writer killed in the middle of a write)."""

import json
import multiprocessing as mp

import pytest

from msjax.events import EventLog, append_event, events_path, read_events


def test_writers_share_one_schema_and_the_reader_filters_by_kind(tmp_path):
    got = []
    log = EventLog(tmp_path / "run", sink=got.append)
    a = log.emit("launch", attempt=0, hosts=["h0"])
    log.close()
    b = append_event(tmp_path / "run", "straggler", step=4, process=1)
    lines = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert lines == [a, b] and got == [a]
    assert [set(e) >= {"time", "kind"} for e in lines] == [True, True]
    assert a["time"] <= b["time"]
    assert read_events(tmp_path / "run") == [a, b]
    assert read_events(tmp_path / "run" / "events.jsonl", "straggler") == [b]
    assert read_events(tmp_path / "nothing") == []
    assert events_path(tmp_path / "run") == events_path(tmp_path / "run" / "events.jsonl")


def test_the_schemas_own_fields_cannot_be_overwritten(tmp_path):
    with pytest.raises(ValueError, match=r"event 'x': field\(s\) \['time'\] are the schema's own"):
        append_event(tmp_path, "x", time=3.0)
    log = EventLog(tmp_path)
    with pytest.raises(ValueError, match="'time'"):
        log.emit("x", time=1.0)
    log.close()
    assert read_events(tmp_path) == []


def test_a_failing_sink_is_recorded_once_and_the_file_stays_the_record(tmp_path):
    calls = []

    def sink(event):
        calls.append(event["kind"])
        raise ConnectionError("redis away")

    log = EventLog(tmp_path, sink=sink)
    log.emit("a")
    log.emit("b")
    log.close()
    kinds = [e["kind"] for e in read_events(tmp_path)]
    assert kinds == ["a", "sink_error", "b"] and calls == ["a"]


def test_a_torn_last_line_is_skipped(tmp_path):
    log = EventLog(tmp_path)
    events = [log.emit("step", step=i, note="x" * 50) for i in range(5)]
    log.close()
    path = tmp_path / "events.jsonl"
    whole = path.read_bytes()
    for cut in (len(whole) - 2, len(whole) - 20, len(whole) - 70):  # the last line cut short at several places
        path.write_bytes(whole[:cut])
        got = read_events(tmp_path)
        assert got == events[:len(got)] and len(got) == whole[:cut].count(b"\n")
    # a torn line in the middle (a crashed writer, then a new one appending) is skipped too
    path.write_bytes(whole[:-20] + b"\n")
    append_event(tmp_path, "restart")
    assert [e["kind"] for e in read_events(tmp_path)] == ["step"] * 4 + ["restart"]


def _write_many(path, tag, n):
    for i in range(n):
        append_event(path, "beat", writer=tag, i=i, pad="y" * 300)


def test_processes_appending_at_once_never_interleave_within_a_line(tmp_path):
    n = 200
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), t, n)) for t in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    rows = read_events(tmp_path)
    assert len(rows) == 3 * n == len((tmp_path / "events.jsonl").read_text().splitlines())
    for t in range(3):
        assert [r["i"] for r in rows if r["writer"] == t] == list(range(n))
