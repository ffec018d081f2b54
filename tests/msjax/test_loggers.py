"""Metrics sinks (`train.loggers`): the real `wandb` client in offline mode gets the same rows as metrics.jsonl (the
learning rate included) and the run's config, and a resumed run continues the same W&B run; the learning rate
reaches TensorBoard; a bad logger name, or wandb asked for but missing, is one ConfigError."""

import importlib.util
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from msjax.config import ConfigError
from msjax.optim import learning_rates
from msjax.train import run
from tests.msjax.tiny_runs import tiny_run_config

pytest.importorskip("wandb")  # the dev extra installs it (pyproject.toml); CI always has it


def _leveldb_records(path: Path) -> list[bytes]:
    """The records of a W&B `.wandb` file: a 7-byte header (":W&B", magic, version), then LevelDB's log format
    (32 KiB blocks of chunks: crc32c (4), length (2), type (1: full, 2: first, 3: middle, 4: last), data). The
    reader wandb shipped for this (wandb.sdk.internal.datastore) left the Python package with its Go core."""
    data, pos, block, records, partial = path.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            records.append(partial + chunk)
    return records


def wandb_history(run_dir: Path) -> tuple[list[dict], dict, list[str]]:
    """(history rows {key: value}, the run's config {key: value}, run ids) of every offline W&B run under run_dir."""
    from wandb.proto import wandb_internal_pb2

    rows, config, ids = [], {}, []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for raw in _leveldb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
            elif kind == "run":
                ids.append(record.run.run_id)
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    return rows, config, ids


def tensorboard_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from the event files directly under tb_dir (TFRecord framing: length (8), its crc (4),
    an Event protobuf, its crc (4); tensorboardX's own protobufs)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12:pos + 12 + length])
            pos += 16 + length
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "msjax-tests")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / f"wandb-{sub}"))  # nothing written to the home directory


@pytest.mark.slow
def test_wandb_offline_gets_what_metrics_jsonl_gets_and_resumes_the_same_run(tmp_path, small_corpus, offline):
    loggers = {"train.loggers": ("jsonl", "tensorboard", "wandb"), "train.sample_tokens": 0}
    cfg = tiny_run_config(tmp_path, small_corpus, **loggers, **{"train.steps": 4})
    run(cfg)
    run_dir = tmp_path / "run"
    rows, config, ids = wandb_history(run_dir)
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert config["model"]["d_model"] == 32 and config["train"]["loggers"] == ["jsonl", "tensorboard", "wandb"]
    logged = {r["step"]: r for r in jsonl if "loss" in r}
    assert logged and all("lr" in r for r in logged.values())
    for row in rows:
        step = row.get("_step")
        for key, value in row.items():
            if not key.startswith("_"):
                want = next(r[key] for r in jsonl if r["step"] == step and key in r)
                assert value == pytest.approx(want, rel=1e-12), (step, key)
    assert {r["_step"] for r in rows if "loss" in r} == set(logged)
    assert {r["_step"] for r in rows if "val_loss" in r} == {r["step"] for r in jsonl if "val_loss" in r}
    # resumed: the same W&B run, continuing after step 4
    run(tiny_run_config(tmp_path, small_corpus, **loggers, **{"checkpoint.resume": True}))
    rows, _, ids = wandb_history(run_dir)
    assert len(ids) == 2 and len(set(ids)) == 1 and (run_dir / "wandb_run_id").read_text() == ids[0]
    assert max(r["_step"] for r in rows) == 8


def test_learning_rate_reaches_tensorboard(tmp_path, small_corpus):
    cfg = tiny_run_config(tmp_path, small_corpus, **{"train.sample_tokens": 0, "train.log_every": 1,
                                                     "train.loggers": ("tensorboard",)})
    run(cfg)
    scalars = tensorboard_scalars(tmp_path / "run" / "tb")
    lrs = learning_rates(cfg.optimizer, cfg.train.steps)
    assert set(scalars["lr"]) == set(range(2, 9))  # every logged step (the first, compiling, is not timed)
    for step, value in scalars["lr"].items():
        np.testing.assert_allclose(value, lrs[step - 1], rtol=1e-6)
    assert lrs[0] > 0 and lrs[1] > lrs[0] and lrs[-1] < lrs[2]  # warmup of 2 steps, then cosine decay
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # jsonl left out of train.loggers


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_tensorboard_writer_loads_without_importing_torch_and_leaves_torch_importable(tmp_path):
    """tensorboardX imports torch, boto3 and google-cloud-storage whenever they are installed (torch alone 1.7 s
    of every run's start here); the writer is loaded without them, writes readable events, and each imports
    normally afterwards. In a fresh interpreter, since this one may hold them already (transformers' tests)."""
    pytest.importorskip("torch")  # the dev extra installs it; without torch there is nothing to keep out
    optional = [m for m in ("boto3", "google.cloud.storage") if _installed(m)]
    code = (
        "import importlib, sys\n"
        "from pathlib import Path\n"
        "from msjax.metrics import MetricsWriter\n"
        f"w = MetricsWriter(loggers=('tensorboard',)).open(Path({str(tmp_path)!r}))\n"
        "w.write(3, {'loss': 1.5}); w.close()\n"
        f"for m in ['torch', *{optional!r}]:\n"
        "    assert m not in sys.modules, f'tensorboardX pulled in {m}'\n"
        f"for m in {optional!r}:\n"
        "    importlib.import_module(m)\n"
        "import torch\n"
        "assert torch.ones(2).sum().item() == 2.0\n"
    )
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert tensorboard_scalars(tmp_path / "tb")["loss"] == {3: 1.5}


def test_bad_logger_names_and_missing_wandb_are_config_errors(tmp_path, small_corpus, monkeypatch):
    with pytest.raises(ConfigError, match=r"train.loggers=jsonl,mlflow: unknown 'mlflow'; allowed: jsonl, "
                                          r"tensorboard, wandb"):
        tiny_run_config(tmp_path, small_corpus, **{"train.loggers": ("jsonl", "mlflow")})
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed: `import wandb` raises
    cfg = tiny_run_config(tmp_path, small_corpus, **{"train.loggers": ("wandb",), "train.sample_tokens": 0})
    with pytest.raises(ConfigError, match=r"pip install 'msjax\[wandb\]'"):
        run(cfg)
