"""Generation (msjax.generate, scripts/generate.py): decoding with the KV cache gives token for token what
recomputing the whole sequence gives (greedy and sampled, batched prompts of different lengths, a sliding-window
ring, a rolling context), on one device and on meshes of 8 fake CPU devices; the sampling filters against NumPy;
the command line end to end on a trained run, with --json and another mesh."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from msjax.config import AttentionConfig, Config, ModelConfig, MoEConfig, apply_overrides
from msjax import generate as generate_module
from msjax.generate import CACHE_BLOCK, Generator, cache_length, decode_rules, generate_text, load_run
from msjax.mesh import make_mesh
from msjax.model import abstract_model, init_params
from msjax.layout import pipeline_rules
from msjax.sample import filter_logits, sample_logits
from msjax.sharding_rules import RULE_SETS
from msjax.train_step import build_train_program

ROOT = Path(__file__).resolve().parents[2]
LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", use_bias=False, tie_embeddings=False, num_kv_heads=2,
             d_ff=48)
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12]]


def tiny(**kw) -> ModelConfig:
    # init_std 0.5: peaked logits, so greedy choices are far from ties and float rounding cannot flip them
    base = dict(vocab_size=50, vocab_multiple=64, num_layers=2, d_model=32, num_heads=4, max_seq_len=24,
                init_std=0.5)
    return ModelConfig(**{**base, **kw})


def _generator(cfg: ModelConfig, seed: int = 0) -> Generator:
    graphdef, _, _ = abstract_model(cfg)
    return Generator(cfg, graphdef, init_params(cfg, jax.random.key(seed)))


MODELS = {
    "gpt": dict(),
    "gpt-window4": dict(attention=AttentionConfig(window=4)),
    "llama-window5": dict(LLAMA, attention=AttentionConfig(window=5)),
    "llama-parallel-unscanned": dict(LLAMA, block="parallel", scan_layers=False),
    # dropless routing: a token's experts and output do not depend on the other tokens routed with it
    "moe": dict(LLAMA, moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ff=16, shared_experts=1,
                                     shared_gate=True)),
}


@pytest.mark.parametrize("model", MODELS)
def test_cached_decoding_equals_recomputing_token_for_token(model):
    gen = _generator(tiny(**MODELS[model]))
    greedy = gen.generate(PROMPTS, 14, temperature=0)
    assert greedy == gen.generate(PROMPTS, 14, temperature=0, cache=False)
    assert [len(g) for g in greedy] == [14] * 4
    assert len({tuple(g) for g in greedy}) > 1  # the prompts lead somewhere different
    sampled = dict(temperature=1.3, top_k=7, top_p=0.9, seed=11)
    assert gen.generate(PROMPTS, 14, **sampled) == gen.generate(PROMPTS, 14, cache=False, **sampled)
    # past model.max_seq_len (24) the context rolls: the last 12 tokens become the prompt, twice over here
    rolled = gen.generate(PROMPTS, 40, temperature=0, rolling=True)
    assert rolled == gen.generate(PROMPTS, 40, temperature=0, rolling=True, cache=False)
    assert [r[:14] for r in rolled] == greedy  # the same up to the first roll (prompt 6 + 14 < 24)


@pytest.mark.parametrize("window", [None, 100])
def test_the_cache_grows_a_block_at_a_time_as_the_rows_fill_it(monkeypatch, window):
    """The KV cache starts at the longest prompt (+1) rounded up to CACHE_BLOCK and grows a block at a time as the
    longest row reaches its end, up to prompt + new tokens, never model.max_seq_len: each decode step attends over
    the filled slots rounded up to a block (a ring of W slots stays W). Decoding against it gives what recomputing
    gives, greedy and sampled."""
    made, slots = [], []
    real_init = generate_module.init_cache
    monkeypatch.setattr(generate_module, "init_cache",
                        lambda cfg, batch, max_len: made.append(max_len) or real_init(cfg, batch, max_len))
    gen = _generator(tiny(**LLAMA, max_seq_len=4 * CACHE_BLOCK, attention=AttentionConfig(window=window)))
    real_decode = gen._decode
    monkeypatch.setattr(gen, "_decode", lambda *a, **kw: slots.append(kw["slots"]) or real_decode(*a, **kw))
    ring = (lambda n: min(n, window)) if window else (lambda n: n)
    long = np.random.default_rng(0).integers(1, 50, CACHE_BLOCK - 5).tolist()
    cases = ((PROMPTS, 14, [CACHE_BLOCK], [CACHE_BLOCK]),  # 10 + 14 tokens: one block, never 4
             ([long, [4]], 14, [CACHE_BLOCK], [CACHE_BLOCK, 2 * CACHE_BLOCK]),  # crosses into the second block
             ([[1, 2, 3]], 2 * CACHE_BLOCK + 20, [CACHE_BLOCK], [CACHE_BLOCK, 2 * CACHE_BLOCK, 3 * CACHE_BLOCK]))
    for prompts, new, prefill, decodes in cases:
        made.clear(), slots.clear()
        got = gen.generate(prompts, new, temperature=0)
        assert made == prefill and slots == [ring(s) for s in decodes], (made, slots)
        assert got == gen.generate(prompts, new, temperature=0, cache=False)
    sampled = dict(temperature=1.3, top_k=7, seed=3)
    assert gen.generate([long, [4]], 14, **sampled) == gen.generate([long, [4]], 14, cache=False, **sampled)
    assert cache_length(5, 14, 100) == 100  # never past the model's context
    assert cache_length(CACHE_BLOCK, 0, 10 * CACHE_BLOCK) == CACHE_BLOCK


def test_a_prompt_in_a_batch_gets_what_it_gets_alone():
    gen = _generator(tiny(**LLAMA))
    batch = gen.generate(PROMPTS, 10, temperature=0)
    for prompt, out in zip(PROMPTS, batch):
        assert gen.generate([prompt], 10, temperature=0) == [out]


@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2, tensor=2), dict(data=2, sequence=2, tensor=2),
                                  dict(pipeline=2, data=2, tensor=2), dict(data=2, expert=2, tensor=2)],
                         ids=["dp-fsdp-tp", "dp-sp-tp", "pp-dp-tp", "moe-dp-ep-tp"])
def test_meshes_generate_what_one_device_generates(mesh):
    """Parameters laid out by the training layout of each mesh (pipeline: layers split over stages; a mixture of
    experts' experts over `expert`, the tokens sent to them by all-to-all); the batch of 4 prompts over data x
    fsdp x expert, 3 prompts padded with a dummy row."""
    moe = {"moe.num_experts": 4, "moe.expert_ff": 16, "moe.shared_experts": 1} if "expert" in mesh else {}
    model = {f"model.{k}": v for k, v in dict(LLAMA, num_kv_heads=2, **moe).items()}
    overrides = {"model.num_layers": 2, "model.d_model": 32, "model.num_heads": 4, "model.max_seq_len": 24,
                 "model.init_std": 0.5, "model.vocab_multiple": 64, "model.attention.window": 6,
                 "train.seq_len": 24, "train.global_batch": 8, **model,
                 **{f"mesh.{k}": v for k, v in {"data": 1, **mesh}.items()}}
    cfg = apply_overrides(Config(), overrides).validate()
    one = apply_overrides(cfg, {f"mesh.{k}": 1 for k in ("pipeline", "data", "fsdp", "expert", "sequence", "tensor")})
    program1 = build_train_program(one, make_mesh(one.mesh, jax.devices()[:1]), vocab_size=50)
    params = init_params(program1.config.model, jax.random.key(3))
    want = Generator(program1.config.model, program1.graphdef, params).generate(PROMPTS[:3], 12, temperature=0)
    layout = make_mesh(cfg.mesh)
    program = build_train_program(cfg, layout, vocab_size=50)
    sharded = jax.device_put(params, program.state_shardings["params"])
    rules = pipeline_rules(RULE_SETS[cfg.mesh.rules], layout.shape["pipeline"])
    gen = Generator(program.config.model, program.graphdef, sharded, layout, rules)
    assert gen.generate(PROMPTS[:3], 12, temperature=0) == want
    assert gen.generate(PROMPTS[:3], 12, temperature=0, cache=False) == want
    assert decode_rules(rules)["act_seq"] is None


def test_sampling_filters_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 40)).astype(np.float32) * 3
    for temperature, k, p in ((1.0, 5, 1.0), (0.7, 0, 0.8), (1.5, 10, 0.5), (1.0, 0, 1.0), (1.0, 1, 1.0)):
        got = np.asarray(filter_logits(logits, temperature, k, p))
        z = logits / temperature
        keep = np.ones_like(z, bool)
        if k:
            keep &= z >= np.sort(z, axis=1)[:, -k][:, None]
        z_k = np.where(keep, z, -np.inf)
        if p < 1:
            order = np.argsort(-z_k, axis=1)
            probs = np.exp(z_k - z_k.max(1, keepdims=True))
            probs /= probs.sum(1, keepdims=True)
            sorted_p = np.take_along_axis(probs, order, 1)
            kept_sorted = np.cumsum(sorted_p, 1) - sorted_p < p
            nucleus = np.zeros_like(keep)
            np.put_along_axis(nucleus, order, kept_sorted, 1)
            keep &= nucleus
        np.testing.assert_array_equal(np.isfinite(got), keep)
        np.testing.assert_allclose(got[keep], z[keep], rtol=1e-6)
    # draws only come from what the filters keep; top_k=1 and greedy pick the argmax
    keys = jax.random.split(jax.random.key(1), 200)
    draws = np.stack([np.asarray(sample_logits(logits, key, 1.0, 3, 1.0)) for key in keys[:50]])
    top3 = np.argsort(-logits, axis=1)[:, :3]
    assert all(d in top3[r] for row in draws for r, d in enumerate(row))
    assert len(set(draws[:, 0].tolist())) > 1  # it does sample
    np.testing.assert_array_equal(sample_logits(logits, keys[0], 1.0, 1, 1.0), logits.argmax(1))
    np.testing.assert_array_equal(sample_logits(logits, keys[0], 0.0, 3, 0.5), logits.argmax(1))


def test_stop_tokens_end_rows():
    gen = _generator(tiny())
    free = gen.generate(PROMPTS, 18, temperature=0)
    stop = free[0][5]
    out = gen.generate(PROMPTS, 18, temperature=0, stop_ids=[stop])
    for f, o in zip(free, out):
        cut = f.index(stop) + 1 if stop in f else len(f)
        assert o == f[:cut]
    assert gen.generate(PROMPTS, 18, temperature=0, stop_ids=[stop], cache=False) == out


def test_the_decode_loop_ends_on_the_device_once_every_row_has_stopped():
    """One chunk of cached decoding is one compiled while loop: it stops after the step at which the last real row
    produced a stop id, not at the chunk's end (the dummy rows that pad a batch do not hold it up)."""
    gen = _generator(tiny())
    free = gen.generate(PROMPTS[:3], 18, temperature=0)
    # stop ids taken from the rows' own greedy tokens: every row stops, each at its first of them
    stops = np.array(sorted({free[0][3], free[1][5], free[2][7]}))
    firsts = [min(r.index(s) for s in stops if s in r) for r in free]
    settings = dict(temperature=0.0, top_k=0, top_p=1.0)
    contexts = [list(p) for p in PROMPTS[:3]] + [[0]]  # a dummy fourth row, as generate pads a batch
    rows = gen._chunk(contexts, 18, jax.random.key(0), 0, True, settings, stops, np.zeros(4, bool), 3)
    assert len(rows[0]) == max(firsts) + 1 < 18
    assert [r[:len(rows[0])] for r in free] == rows[:3]


@pytest.mark.parametrize("call, match", [
    (lambda g: g.generate([[1], []], 3), "prompt 1 has no tokens"),
    (lambda g: g.generate([[1, 50]], 3), r"prompt 0 holds token ids outside the vocabulary \[0, 50\): \[50\]"),
    (lambda g: g.generate([[1] * 20], 5), r"a prompt of 20 tokens \+ --max_new_tokens=5 = 25 tokens is longer than "
                                          r"the model's context \(model.max_seq_len=24\)"),
    (lambda g: g.generate([[1]], 0), "--max_new_tokens=0: allowed is an integer >= 1"),
    (lambda g: g.generate([[1]], 3, temperature=1.0, top_p=0.0), "--top_p=0.0: allowed is 0 < top_p <= 1"),
    (lambda g: g.generate([[1]], 3, temperature=1.0, top_k=-1), "--top_k=-1: allowed is an integer >= 0"),
])
def test_bad_requests_name_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call(_generator(tiny()))


# ---------------------------------------------------------------------------------------------------------------
# From a trained run, in Python and through scripts/generate.py.


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_corpus):
    from msjax.train import run
    from tests.msjax.tiny_runs import tiny_run_config

    tmp = tmp_path_factory.mktemp("gen_run")
    cfg = tiny_run_config(tmp, small_corpus, **{"train.steps": 12, "optimizer.decay_steps": 12, "checkpoint.every": 6,
                                               "model.position": "rope", "model.norm": "rmsnorm",
                                               "model.mlp": "swiglu", "model.attention.window": 8})
    summary = run(cfg)
    assert summary.sample  # the loop's own end-of-run sample decodes with the cache (rolling past 32)
    return tmp / "run"


def _script(*flags: str, devices: int = 1) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, "scripts/generate.py", *flags], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_generate_script_writes_json_and_any_mesh_agrees(trained_run, tmp_path):
    prompts = ["def f(x, y):", "import os"]
    in_process = generate_text(load_run(trained_run), prompts, 16, temperature=0)  # the run's own mesh (8 devices)
    one = tmp_path / "one.json"
    proc = _script(f"--run_dir={trained_run}", f"--prompt={prompts[0]}", "--prompt", prompts[1],
                   "--max_new_tokens=16", "--temperature=0", f"--json={one}", "--mesh.data=1", "--mesh.fsdp=1",
                   "--mesh.tensor=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(one.read_text())
    assert doc["step"] == 12 and doc["temperature"] == 0.0 and len(doc["results"]) == 2
    for r, want in zip(doc["results"], in_process):
        assert r["prompt"] == want.prompt and r["prompt_ids"] == want.prompt_ids
        assert r["generated_ids"] == want.generated_ids and r["text"] == want.text
        assert r["text"] in proc.stdout
    two = tmp_path / "two.json"
    proc = _script(f"--run_dir={trained_run}", f"--prompt={prompts[0]}", f"--prompt={prompts[1]}",
                   "--max_new_tokens=16", "--temperature=0", f"--json={two}", "--mesh.data=1", "--mesh.fsdp=1",
                   "--mesh.tensor=2", "--cache=false", devices=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(two.read_text())["results"] == doc["results"]  # tensor-parallel, uncached: the same tokens
    assert json.loads(two.read_text())["mesh"]["tensor"] == 2


def _tampered(run: Path, tmp_path: Path, part: str) -> Path:
    """A copy of `run` whose newest checkpoint's record holds a wrong checksum for the first array under `part`."""
    import shutil

    from msjax.checkpoint.integrity import RECORD_NAME

    copy = tmp_path / f"run_{part}"
    shutil.copytree(run, copy)
    newest = max((d for d in (copy / "checkpoints").iterdir() if d.name.isdigit()), key=lambda d: int(d.name))
    record = json.loads((newest / RECORD_NAME).read_text())
    key = next(k for k in sorted(record["checksums"]) if k.startswith(f"['{part}']"))
    record["checksums"][key] = "0" * 16
    (newest / RECORD_NAME).write_text(json.dumps(record))
    for older in (copy / "checkpoints").iterdir():  # no older checkpoint to fall back to
        if older.name.isdigit() and older != newest:
            shutil.rmtree(older)
    return copy


@pytest.mark.slow
def test_generation_reads_and_verifies_only_the_parameters(trained_run, tmp_path):
    """load_run restores {"params"} alone (Orbax partial restore): the optimizer state is neither read nor compared,
    so a wrong optimizer checksum does not stop it (a whole restore refuses that checkpoint), while a wrong
    parameter checksum does; --dtype=bfloat16 gives the stored parameters rounded, and a generator in bfloat16."""
    from msjax.checkpoint import CheckpointError, Checkpointer, checkpoint_dir
    from msjax.runs import run_config

    mesh = {}  # the run's own mesh (8 devices)
    stored = load_run(trained_run, mesh)
    assert stored.step == 12 and set(stored.generator.params) == set(abstract_model(stored.config.model)[1])
    assert {x.dtype for x in jax.tree.leaves(stored.generator.params)} == {np.dtype("float32")}

    opt_bad = _tampered(trained_run, tmp_path, "opt_state")
    assert load_run(opt_bad, mesh).step == 12
    cfg = run_config(opt_bad, mesh)
    program = build_train_program(cfg)
    ckpt = Checkpointer(cfg.checkpoint, checkpoint_dir(cfg.checkpoint, str(opt_bad)), read_only=True)
    try:
        with pytest.raises(CheckpointError, match=r"checksum mismatch in 1 array\(s\): \['opt_state'\]"):
            ckpt.restore(program.abstract_state)
    finally:
        ckpt.close()
    with pytest.raises(CheckpointError, match=r"checksum mismatch in 1 array\(s\): \['params'\]"):
        load_run(_tampered(trained_run, tmp_path, "params"), mesh)

    half = load_run(trained_run, mesh, dtype="bfloat16")
    assert (half.config.model.param_dtype, half.config.model.dtype) == ("bfloat16", "bfloat16")
    for a, b in zip(jax.tree.leaves(stored.generator.params), jax.tree.leaves(half.generator.params)):
        assert b.dtype == jax.numpy.bfloat16 and b.sharding == a.sharding  # cast where it lies, on 8 devices
        np.testing.assert_array_equal(np.asarray(a.astype(jax.numpy.bfloat16)), np.asarray(b))
    by_hand = Generator(half.config.model, abstract_model(half.config.model)[0],
                        jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), stored.generator.params))
    ids = [[5, 6, 7], [8]]
    assert half.generator.generate(ids, 8, temperature=0) == by_hand.generate(ids, 8, temperature=0)


@pytest.mark.slow
def test_a_checkpoint_without_parameters_is_one_error(trained_run, tmp_path):
    """A real checkpoint (Checkpointer.save) of a state with no "params": generate.py says so in one line, exit 2."""
    import shutil

    from msjax.checkpoint import Checkpointer, checkpoint_dir
    from msjax.runs import run_config

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    cfg = run_config(run)
    ckpt = Checkpointer(cfg.checkpoint, checkpoint_dir(cfg.checkpoint, str(run)))
    try:
        ckpt.save(20, {"opt_state": {"mu": jax.numpy.ones((4, 4))}}, {"step": 20}, force=True)
        ckpt.wait()
    finally:
        ckpt.close()
    proc = _script(f"--run_dir={run}", "--prompt=x", "--mesh.data=1", "--mesh.fsdp=1", "--mesh.tensor=1")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("error: "), proc.stderr[-2000:]
    assert "the newest checkpoint (step 20) holds no parameters (its arrays are under ['opt_state'])" in last, last


@pytest.mark.slow
def test_generate_script_takes_jsonl_prompts_and_a_dtype(trained_run, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"def f(x):\\n    return"\n\n{"prompt": "import os"}\n')
    out = tmp_path / "out.json"
    proc = _script(f"--run_dir={trained_run}", f"--prompt_file={prompts}", "--max_new_tokens=6", "--temperature=0",
                   "--dtype=bfloat16", f"--json={out}", "--mesh.data=1", "--mesh.fsdp=1", "--mesh.tensor=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["dtype"] == "bfloat16" and [r["prompt"] for r in doc["results"]] == ["def f(x):\n    return",
                                                                                    "import os"]
    bad = tmp_path / "bad.jsonl"
    for text, needle in (('"ok"\n{"prompt": 3}\n', "line 2: allowed is a JSON string or an object"),
                         ('"ok"\n\n{oops\n', "line 3: not JSON")):
        bad.write_text(text)
        proc = _script(f"--run_dir={trained_run}", f"--prompt_file={bad}")
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: "), proc.stderr
        assert needle in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("flags, needle", [
    ([], "--run_dir is required"),
    (["--run_dir={run}"], "give at least one --prompt"),
    (["--run_dir={run}", "--prompt=x", "--max_new_tokens=100"], "is longer than the model's context"),
    (["--run_dir={run}", "--prompt=x", "--top_p=2"], "--top_p=2.0: allowed is 0 < top_p <= 1"),
    (["--run_dir={run}", "--prompt=x", "--dtype=float16"], "--dtype='float16': allowed: 'float32', 'bfloat16'"),
    (["--run_dir=/nonexistent/run", "--prompt=x"], "no such file"),
])
def test_generate_script_errors_are_one_line(trained_run, flags, needle):
    proc = _script(*[f.format(run=trained_run) for f in flags], "--mesh.data=1", "--mesh.fsdp=1", "--mesh.tensor=1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]  # (after the checkpoint restore's INFO lines, when it got there)
    assert last.startswith("error: ") and needle in last, proc.stderr[-2000:]


@pytest.mark.slow
def test_generation_memory_benchmark_measures_every_mode(trained_run, tmp_path):
    """scripts/bench_generate_memory.py: the three modes, each in its own process, with their table and JSON; the
    bfloat16 parameters are half the float32 ones, every mode generates every token."""
    out = tmp_path / "memory.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    proc = subprocess.run([sys.executable, "scripts/bench_generate_memory.py", f"--run_dir={trained_run}",
                           "--batch=2", "--new_tokens=4", f"--json={out}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"train_state", "params", "params_bf16"} and "peak-base MiB" in proc.stdout
    assert rows["params"]["param_bytes"] == rows["train_state"]["param_bytes"] == 2 * rows["params_bf16"]["param_bytes"]
    assert all(r["generated"] == 8 and r["peak_bytes"] >= r["baseline_bytes"] for r in rows.values())


def test_generation_benchmark_runs_and_both_modes_agree(tmp_path):
    """scripts/bench_generate.py --smoke: the table and JSON, both modes timed, the same tokens from both."""
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    proc = subprocess.run([sys.executable, "scripts/bench_generate.py", "--smoke", "--repeats=1",
                           "--model.attention.window=4", f"--json={out}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["same_tokens"] is True and "tokens/s" in proc.stdout
    assert {(r["batch"], r["mode"]) for r in doc["rows"]} == {(b, m) for b in (1, 2) for m in ("kv_cache", "recompute")}
    assert all(r["tokens_per_s"] > 0 and r["cache_slots"] == 4 for r in doc["rows"])  # the window's ring of 4 slots
