import dataclasses
import importlib
import json

import jax
import pytest

from msjax.cli import parse
from msjax.config import Config, ConfigError, apply_overrides, flat_keys, load_preset, preset_names
from msjax.mesh import make_mesh, resolve_axis_sizes

EXPECTED_PRESETS = {"gpt_tiny", "shakespeare_char", "gpt_125m", "gpt_1_3b", "gpt_13b", "gpt175b", "gpt530b",
                    "llama_tiny", "moe_tiny", "mixtral_8x7b", "qwen3_30b_a3b", "llama3_8b", "llama3_70b", "llama3_1_8b",
                    "qwen2_5_7b", "qwen3_8b", "mistral_7b"}


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_validates(name):
    cfg = load_preset(name).validate()
    assert cfg.name == name


def test_required_presets_exist():
    assert EXPECTED_PRESETS <= set(preset_names())


def test_megascale_shapes():
    c175, c530 = load_preset("gpt175b"), load_preset("gpt530b")
    assert (c175.model.num_layers, c175.model.d_model, c175.model.num_heads) == (96, 12288, 128)
    assert (c530.model.num_layers, c530.model.d_model, c530.model.num_heads) == (105, 20480, 160)
    for c in (c175, c530):
        assert (c.train.seq_len, c.model.vocab_size, c.optimizer.name) == (2048, 64000, "lamb")


def test_llama3_shapes():
    """Llama 3 (Meta 2024, Table 3): parameter counts 8.03B and 70.6B from the model's own inventory."""
    from msjax.model import abstract_model

    for name, shape, params in (("llama3_8b", (32, 4096, 32, 8, 14336), 8.03e9),
                                ("llama3_70b", (80, 8192, 64, 8, 28672), 70.55e9)):
        m = load_preset(name).model
        assert (m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff) == shape
        assert (m.position, m.norm, m.mlp, m.use_bias, m.tie_embeddings) == ("rope", "rmsnorm", "swiglu", False, False)
        assert (m.rope_base, m.vocab_size, m.max_seq_len) == (500000.0, 128256, 8192)
        count = sum(x.size for x in jax.tree.leaves(abstract_model(m)[1]))
        assert count == pytest.approx(params, rel=2e-3), (name, count)


def test_presets_override_only_what_differs():
    import importlib

    defaults = flat_keys(Config())
    for name in preset_names():
        overrides = importlib.import_module(f"msjax.configs.{name}").OVERRIDES
        same = [k for k, v in overrides.items() if defaults[k] == v]
        assert not same, f"preset {name} repeats defaults: {same}"


def test_dotted_overrides_parse_types():
    cfg, _ = parse(["--config=gpt_tiny", "--train.steps=7", "--optimizer.lr=3e-4", "--model.block=parallel",
                    "--model.attention.window", "16", "--train.progress=false", "--resume", "--data.paths=a.txt,b.txt"])
    assert cfg.train.steps == 7 and cfg.optimizer.lr == 3e-4 and cfg.model.block == "parallel"
    assert cfg.model.attention.window == 16 and cfg.train.progress is False and cfg.checkpoint.resume is True
    assert cfg.data.paths == ("a.txt", "b.txt")
    cfg, _ = parse(["--model.attention.window=none"])
    assert cfg.model.attention.window is None


@pytest.mark.parametrize("argv, needle", [
    (["--config=nope"], "unknown preset --config='nope'; allowed: chat_sft, gpt175b"),
    (["--train.stepz=3"], "unknown config key 'train.stepz'; allowed at this level: train.eval_batches"),
    (["--trian.steps=3"], "unknown config key 'trian.steps'; allowed at this level: checkpoint, data"),
    (["--train.steps=ten"], "train.steps='ten': allowed is int"),
    (["--train.steps=1.5"], "train.steps='1.5': allowed is int"),
    (["--model.block=diagonal"], "model.block='diagonal': allowed is one of 'serial', 'parallel'"),
    (["--train.progress=maybe"], "train.progress='maybe': allowed is bool"),
    (["--model.attention.window=0"], "model.attention.window=0: allowed is an integer >= 1, or None"),
    (["--train.seq_len=4096"], "train.seq_len=4096 is longer than the model's positions (model.max_seq_len=128)"),
    (["--mesh.tensor=4"], "model.num_heads=6 is not divisible by the tensor-parallel size mesh.tensor=4"),
    (["--model.d_model=204", "--model.num_heads=8", "--model.head_dim=16", "--mesh.tensor=8"],
     "model.d_model=204 is not divisible by the tensor-parallel size mesh.tensor=8"),
    (["--mesh.rules=zero4"], "mesh.rules='zero4' is unknown; allowed: ['dp', 'fsdp', 'fsdp_tp', 'tp', 'zero2']"),
    (["--train"], "flag --train needs a value"),
    (["--train=3"], "'train' is a section"),
    (["--model.num_kv_heads=4"], "model.num_heads=6 must be a multiple of model.num_kv_heads=4"),
    (["--model.scan_unroll=0"], "model.scan_unroll=0: allowed is an integer >= 1"),
    (["--model.scan_unroll=2"], "above 1 only with model.scan_layers=true"),  # gpt_tiny loops over layers
    (["--train.steps_per_execution=0"], "train.steps_per_execution=0: allowed is an integer >= 1"),
    (["--train.steps_per_execution=2", "--train.nonfinite=stop"], "train.nonfinite=stop stops at the exact step"),
    (["--train.steps_per_execution=2", "--observe.own_compute=true"], "needs train.steps_per_execution=1"),
    (["--model.rope_scaling.type=llama3"], "model.rope_scaling.type='llama3' scales RoPE's frequencies; "
                                           "model.position='learned' has none"),
    (["--model.position=rope", "--model.rope_scaling.type=longrope"],
     "model.rope_scaling.type='longrope': allowed is one of 'none', 'linear', 'llama3', 'yarn'"),
    (["--model.position=rope", "--model.rope_scaling.type=yarn", "--model.rope_scaling.factor=4"],
     "model.rope_scaling.original_max_seq_len=0: yarn scaling needs the context before scaling"),
    (["--model.position=rope", "--model.rope_scaling.type=linear", "--model.rope_scaling.factor=0.5"],
     "model.rope_scaling.factor=0.5: allowed is a finite number >= 1"),
    (["--model.position=rope", "--model.rope_scaling.type=llama3", "--model.rope_scaling.factor=8"],
     "model.rope_scaling.original_max_seq_len=0: llama3 scaling needs the context before scaling"),
    (["--model.position=rope", "--model.rope_scaling.type=llama3", "--model.rope_scaling.original_max_seq_len=64",
      "--model.rope_scaling.high_freq_factor=1"], "allowed are finite numbers 0 < low < high"),
])
def test_bad_flags_name_the_key_and_the_allowed_values(argv, needle):
    with pytest.raises(ConfigError) as e:
        parse(["--config=gpt_tiny", *argv])
    assert needle in str(e.value)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_preset("gpt_tiny").train.steps = 3


def test_mesh_size_must_match_devices():
    cfg = apply_overrides(Config(), {"mesh.tensor": 2, "mesh.fsdp": 2, "mesh.data": 3})
    with pytest.raises(ConfigError, match="has 12 devices but 8 are present"):
        make_mesh(cfg.mesh)
    cfg = apply_overrides(Config(), {"mesh.tensor": 3})
    with pytest.raises(ConfigError, match="needs a multiple of 3 devices; 8 present"):
        make_mesh(cfg.mesh)
    assert resolve_axis_sizes(apply_overrides(Config(), {"mesh.tensor": 2}).mesh, 8)["data"] == 4
    mesh = make_mesh(apply_overrides(Config(), {"mesh.fsdp": 2, "mesh.tensor": 2}).mesh)
    assert dict(mesh.shape) == {"pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}


# ---------------------------------------------------------------------------------------------------------------
# --config=PATH: preset files, YAML, JSON, a run directory's config.json.


def test_config_files_of_every_kind_give_the_same_config(tmp_path):
    from msjax.config import to_dict

    want = apply_overrides(load_preset("gpt_tiny"), {"model.num_layers": 3, "model.attention.window": 16,
                                                     "data.paths": ("a.txt", "b.txt"), "train.progress": False})
    (tmp_path / "mine.py").write_text("from msjax.configs.gpt_tiny import OVERRIDES as BASE\n"
                                      "OVERRIDES = {**BASE, 'model.num_layers': 3, 'model.attention.window': 16,\n"
                                      "             'data.paths': ('a.txt', 'b.txt'), 'train.progress': False}\n")
    (tmp_path / "mine.yaml").write_text("model:\n  num_layers: 3\n  attention: {window: 16}\n"
                                        "data.paths: [a.txt, b.txt]\ntrain: {progress: false}\n" + "".join(
        f"{k}: {v!r}\n" for k, v in importlib.import_module("msjax.configs.gpt_tiny").OVERRIDES.items()
        if k != "model.num_layers"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(dataclasses.replace(want, name="gpt_tiny")), indent=2))
    for spec in (tmp_path / "mine.py", tmp_path / "mine.yaml", run / "config.json", run):
        cfg, _ = parse([f"--config={spec}"])
        assert dataclasses.replace(cfg, name="x") == dataclasses.replace(want, name="x").validate(), spec
    assert parse([f"--config={tmp_path / 'mine.py'}"])[0].name == "mine"
    assert parse([f"--config={run}"])[0].name == "gpt_tiny"  # the run's own name
    # flags still override the file
    cfg, _ = parse([f"--config={run / 'config.json'}", "--model.num_layers=5", "--train.steps=9"])
    assert (cfg.model.num_layers, cfg.train.steps, cfg.model.attention.window) == (5, 9, 16)


def test_a_run_config_json_reproduces_the_run_exactly(tmp_path):
    """Every key a run wrote (its vocabulary size filled in, non-default values everywhere) reads back equal."""
    from msjax.config import to_dict

    saved = apply_overrides(load_preset("llama_tiny"), {
        "model.vocab_size": 4099, "model.rope_base": 1234.5, "optimizer.name": "lamb", "mesh.tensor": 2,
        "data.paths": ("x.txt",), "model.attention.window": None, "checkpoint.local_dir": "/dev/shm/x"})
    (tmp_path / "config.json").write_text(json.dumps(to_dict(saved), indent=2))
    assert load_preset(str(tmp_path / "config.json")) == saved


@pytest.mark.parametrize("content, suffix, needle", [
    ("model:\n  d_modle: 3\n", ".yaml", "unknown config key 'model.d_modle'"),
    ('{"train": {"steps": "many"}}', ".json", "train.steps='many': allowed is int"),
    ("[1, 2]", ".json", "must hold a mapping of config keys"),
    ("{bad json", ".json", "not valid JSON"),
    ("model: [\n", ".yaml", "not valid YAML"),
    ("X = 1\n", ".py", "a preset file defines OVERRIDES"),
    ("raise RuntimeError('boom')\n", ".py", "failed to run: RuntimeError: boom"),
    ("OVERRIDES = {'model.block': 'diagonal'}\n", ".py", "model.block='diagonal': allowed is one of"),
])
def test_bad_config_files_name_the_file_and_the_problem(tmp_path, content, suffix, needle):
    path = tmp_path / f"bad{suffix}"
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        parse([f"--config={path}"])
    assert needle in str(e.value) and str(path) in str(e.value), str(e.value)


def test_missing_config_file_and_wrong_type_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        parse([f"--config={tmp_path / 'nope.yaml'}"])
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigError, match=r"allowed file types are \.py, \.yaml, \.yml, \.json"):
        parse([f"--config={tmp_path / 'c.toml'}"])


@pytest.mark.slow
def test_shakespeare_char_runs_from_any_directory(tmp_path):
    """The preset's corpus ships inside the package: a run from an empty directory finds it (nothing beside the
    checkout is needed) and trains on its 1,115,394 bytes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    corpus = Path(load_preset("shakespeare_char").data.paths[0])
    assert corpus.is_file() and corpus.stat().st_size == 1_115_394
    assert Path(load_preset("shakespeare_char").data.paths[0]).is_absolute()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "MSJAX_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(root / "scripts" / "train.py"), "--config=shakespeare_char",
                           "--train.steps=2", "--train.eval_every=0", "--train.eval_batches=1",
                           "--train.sample_tokens=0", "--train.progress=false", "--train.run_dir=run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((tmp_path / "run" / "config.json").read_text())
    assert meta["data"]["paths"] == [str(corpus)] and meta["model"]["vocab_size"] == 65  # nanoGPT's 65 characters


def test_resume_check_reads_configs_saved_before_the_new_keys():
    """A checkpoint saved before model.position/norm/mlp/rope_base and train.loggers existed resumes with their
    defaults; a saved Llama block still may not resume as a GPT one; the loggers may change on resume."""
    from msjax.checkpoint.resume import config_differences
    from msjax.config import to_dict

    cfg = load_preset("gpt_tiny")
    saved = json.loads(json.dumps(to_dict(cfg)))
    for key in ("position", "norm", "mlp", "rope_base"):
        del saved["model"][key]
    del saved["train"]["loggers"]
    assert config_differences(saved, cfg) == []
    assert config_differences(saved, apply_overrides(cfg, {"train.loggers": ("wandb",)})) == []
    saved["model"]["mlp"] = "swiglu"
    assert config_differences(saved, cfg) == ["model.mlp: 'swiglu' -> 'gelu'"]


def test_an_untrained_checkpoint_resumes_on_other_data():
    """A checkpoint of step 0 (an imported model) resumes with another corpus, data format and batch shape: no
    batch of its stream was drawn; from step 1 on the same changes are refused, and at step 0 the model's keys
    still must match."""
    from msjax.checkpoint.resume import config_differences
    from msjax.config import to_dict

    cfg = load_preset("gpt_tiny")
    saved = json.loads(json.dumps(to_dict(cfg)))
    sft = apply_overrides(cfg, {"data.format": "chat", "data.paths": ("chats.jsonl",), "train.global_batch": 4})
    assert config_differences(saved, sft, step=0) == []
    assert config_differences(saved, sft, step=1) == ["data.format: 'text' -> 'chat'",
                                                      "data.paths: [] -> ['chats.jsonl']",
                                                      "train.global_batch: 16 -> 4"]
    assert config_differences(saved, apply_overrides(sft, {"model.d_model": 64}), step=0) == [
        "model.d_model: 192 -> 64"]


def test_presets_compose_left_to_right():
    """`--config=A,B`: B's keys over A's, the run named after A; an unknown part is one error naming it."""
    cfg = load_preset("llama_tiny,chat_sft")
    assert cfg.name == "llama_tiny" and cfg.data.format == "chat" and cfg.optimizer.lr == 2e-5
    assert cfg.model.mlp == "swiglu" and cfg.train.run_dir == "runs/llama_tiny"
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        load_preset("llama_tiny,nope")
