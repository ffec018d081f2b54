"""Hugging Face checkpoints both ways, checked by the real `transformers` and `torch` (CPU):

- random GPT-2 and Llama models (odd sizes, several layers, grouped-query heads, biases on and off, tied and
  untied) imported into msjax give `transformers`' logits within 1e-4 (float32), and exported back give the
  same tensors bit for bit;
- a model msjax trained for a few steps, exported, loads with `AutoModelForCausalLM` / `AutoTokenizer` and gives
  msjax's logits within 1e-4; imported again it is bit-identical to the checkpoint it came from;
- greedy generation of an imported model equals `transformers`' `generate(do_sample=False)`;
- an imported run resumes training on another mesh and generates through scripts/generate.py;
- what msjax cannot represent is one error naming the field or tensor.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the dev extra installs both (pyproject.toml); CI always has them
transformers = pytest.importorskip("transformers")

from msjax.config import MoEConfig  # noqa: E402
from msjax.data import ByteTokenizer, CharTokenizer, HFTokenizer  # noqa: E402
from msjax.generate import generate_text, load_run  # noqa: E402
from msjax.runs import run_config  # noqa: E402
from msjax.hf import HFConversionError, export_hf, import_hf  # noqa: E402
from msjax.hf.tokenizer import hf_tokenizer_json  # noqa: E402
from msjax.model import apply  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4  # float32 logits of O(1-10): both sides sum in different orders
ONE_DEVICE = {"mesh.pipeline": 1, "mesh.data": 1, "mesh.fsdp": 1, "mesh.sequence": 1, "mesh.tensor": 1}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A real byte-level BPE (msjax's own trainer) on a few standard-library sources: 300 tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / n).read_text() for n in ("textwrap.py", "shlex.py", "glob.py")]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    HFTokenizer.train(texts, 300).save(path)
    return path


VOCAB = 311  # > the tokenizer's 300: a model's vocabulary may be larger than its tokenizer's

# Odd sizes: GPT-2 with 3 heads of 12 and an MLP of 100 (not 4 d); Llama with 6 query heads over 2 key/value heads
# (head_dim 8), an MLP of 84, RoPE base 5000; the third adds biases and ties the embeddings.
MODELS = {
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_positions=40, n_embd=36, n_layer=3, n_head=3, n_inner=100,
                                layer_norm_epsilon=1e-5)),
    "llama": ("LlamaConfig", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=84, num_hidden_layers=3,
                                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                  rope_theta=5000.0, rms_norm_eps=1e-5)),
    "llama-bias-tied": ("LlamaConfig", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                            head_dim=10, max_position_embeddings=48, attention_bias=True,
                                            mlp_bias=True, tie_word_embeddings=True)),
    # Llama 3.1's frequency scaling at a size where its three regimes all occur: head_dim 16, base 10000 and an
    # original context of 64 give wavelengths 6.3 (kept: < 64 / 4), 20 (interpolated) and 63-6300 (divided by 8).
    "llama31": ("LlamaConfig", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=72, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64},
                                    rms_norm_eps=1e-5)),
    # Qwen2.5 with its long-context recipe (YaRN, factor 4 over an original context of 32 here, so that the ramp
    # between kept and interpolated frequencies falls inside head_dim 16): cos and sin scaled by 0.1 ln 4 + 1.
    "qwen2-yarn": ("Qwen2Config", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                        "original_max_position_embeddings": 32},
                                       rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # Qwen2.5's family: biases on q, k and v alone, tied embeddings (as its 0.5B-3B models), RoPE base 1e6.
    "qwen2": ("Qwen2Config", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # Qwen2.5 7B's and larger: untied embeddings, its own output projection.
    "qwen2-untied": ("Qwen2Config", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # Qwen3's: an RMSNorm over each query and key head, head_dim 16 wider than hidden / heads = 12.
    "qwen3": ("Qwen3Config", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6,
                                  tie_word_embeddings=False)),
    # Mistral 7B v0.1's family: a sliding window (7 here: each query sees itself and the 6 tokens before it),
    # compared over 64 positions, so most queries see a window, not the whole prefix.
    "mistral": ("MistralConfig", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                      sliding_window=7, rope_theta=10000.0, rms_norm_eps=1e-5)),
    # Mixtral's: every MLP 6 experts of width 40, top-2 (softmax, renormalised), random router weights, so some
    # experts get many more tokens than others; a sliding window of 9
    "mixtral": ("MixtralConfig", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                      num_local_experts=6, num_experts_per_tok=2, sliding_window=9,
                                      rope_theta=10000.0, rms_norm_eps=1e-5)),
    # Qwen2-MoE's: experts of width 16 (top-2 of 6, not renormalised), a shared expert of 32 (two experts' width)
    # behind a sigmoid gate, biases on q/k/v, and every second layer sparse (the others dense MLPs of 40)
    "qwen2-moe": ("Qwen2MoeConfig", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40,
                                         moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                         num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
                                         max_position_embeddings=64, num_experts=6, num_experts_per_tok=2,
                                         decoder_sparse_step=2, rope_theta=1e6, rms_norm_eps=1e-6)),
    # Qwen3-MoE's (Qwen3-30B-A3B's form): query/key norms, head_dim 16, top-3 of 8 experts renormalised
    "qwen3-moe": ("Qwen3MoeConfig", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40,
                                         moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                         num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, rope_theta=1e6,
                                         rms_norm_eps=1e-6)),
}
# A layout per model that splits what it can over 8 devices (GPT-2's 3 heads do not split over tensor); the third
# keeps one parameter set per layer (`layers.i`) instead of stacked `blocks`.
LAYOUTS = {"gpt2": {"mesh.data": 2, "mesh.fsdp": 4}, "llama": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
           "llama-bias-tied": {"mesh.data": 4, "mesh.fsdp": 2, "model.scan_layers": False},
           "llama31": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
           "qwen2": {"mesh.data": 4, "mesh.tensor": 2},
           "qwen2-yarn": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
           "qwen2-untied": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
           "qwen3": {"mesh.fsdp": 4, "mesh.tensor": 2},
           "mistral": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
           "mixtral": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
           "qwen2-moe": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
           "qwen3-moe": {"mesh.fsdp": 4, "mesh.tensor": 2}}


def _random_hf_model(kind: str, seed: int = 0):
    config_cls, kwargs = MODELS[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # every tensor random, well away from init (norm gains near 1, biases nonzero)
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name or "ln_" in name else 0.15 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tokenizer_file) -> dict:
    """Each random model saved by `save_pretrained` (safetensors) with the tokenizer, as a user's download."""
    from tokenizers import Tokenizer, processors

    out = {}
    for kind in MODELS:
        d = tmp_path_factory.mktemp(f"hf-{kind}")
        model = _random_hf_model(kind)
        model.save_pretrained(d)
        tok = Tokenizer.from_file(str(tokenizer_file))
        # a begin-of-text token the tokenizer's post-processor adds, as Llama's does
        if kind.startswith(("llama", "qwen", "mistral", "mixtral")):
            tok.add_special_tokens(["<|begin_of_text|>"])
            bos = tok.token_to_id("<|begin_of_text|>")
            tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                               special_tokens=[("<|begin_of_text|>", bos)])
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "eos_token": "<|endoftext|>"}))
        out[kind] = (d, model)
    return out


@pytest.fixture(scope="module")
def imported(hf_dirs, tmp_path_factory) -> dict:
    """Each model imported onto its 8-device layout (placed on the shards tensor by tensor)."""
    return {kind: import_hf(d, tmp_path_factory.mktemp(f"run-{kind}") / "run", overrides=LAYOUTS[kind])
            for kind, (d, _) in hf_dirs.items()}


def _tokens(seed: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (2, length)).astype(np.int32)


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _msjax_logits(run, tokens: np.ndarray) -> np.ndarray:
    g = run.generator
    return np.asarray(apply(g.graphdef, g.params, tokens))[..., :run.config.model.vocab_size]


@pytest.mark.parametrize("rope_type, fields", [
    ("linear", {"factor": 4.0}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}),  # Llama 3.1's own
    ("llama3", {"factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                "original_max_position_embeddings": 256}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen2.5's 128K recipe
    ("yarn", {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707,
              "beta_fast": 24.0, "beta_slow": 2.0}),  # DeepSeek's attention factor, other ramp bounds
    ("yarn", {"factor": 8.0, "original_max_position_embeddings": 2048, "truncate": False,
              "attention_factor": 1.25}),
])
def test_scaled_rope_frequencies_equal_transformers(rope_type, fields):
    """msjax.ops.rope.inverse_frequencies and attention_factor against `transformers`' own rope initialisation,
    head_dim 128 and Llama 3's base: every one of the 64 frequencies within 1e-6 relative (both in float32); the
    factor on cos and sin equal (1 but for yarn)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from msjax.config import RopeScalingConfig
    from msjax.hf.arch import ROPE_TYPES
    from msjax.ops.rope import attention_factor, inverse_frequencies

    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                                      rope_parameters={"rope_type": rope_type, "rope_theta": 500000.0, **fields})
    want, want_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    scaling = RopeScalingConfig(type=rope_type, **{key: fields[hf_key] for hf_key, key in ROPE_TYPES[rope_type]
                                                   if hf_key in fields})
    got = np.asarray(inverse_frequencies(128, 500000.0, scaling))
    assert attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)
    assert (want_factor == 1.0) == (rope_type != "yarn")
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=0)
    assert not np.allclose(got, np.asarray(inverse_frequencies(128, 500000.0)))  # the scaling changed something


@pytest.mark.parametrize("kind", MODELS)
def test_imported_model_gives_transformers_logits(hf_dirs, imported, kind):
    _, model = hf_dirs[kind]
    result = imported[kind]
    assert result.arch == model.config.architectures[0]
    assert result.param_count >= sum(p.numel() for p in model.parameters())  # + the vocabulary padding
    run = load_run(result.run_dir, overrides=ONE_DEVICE, devices=jax.devices()[:1])
    assert run.step == 0
    tokens = _tokens(1, model.config.max_position_embeddings if kind != "gpt2" else 40)
    want = _hf_logits(model, tokens)
    assert np.abs(want).max() > 1.0  # the comparison is not of near-zeros
    np.testing.assert_allclose(_msjax_logits(run, tokens), want, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", MODELS)
def test_export_gives_the_original_tensors_bit_for_bit(hf_dirs, imported, kind, tmp_path):
    """HF -> msjax -> HF: `transformers` loads the export and every tensor equals the original exactly (so do
    the logits); restored here onto one device, not the import's 8-device layout."""
    _, model = hf_dirs[kind]
    out = export_hf(imported[kind].run_dir, tmp_path / "out", overrides=ONE_DEVICE, devices=jax.devices()[:1],
                    max_shard_bytes=40_000)
    assert "model.safetensors.index.json" in out.files  # several shards of <= 40 kB, with the index
    back = transformers.AutoModelForCausalLM.from_pretrained(out.out_dir).eval()
    theirs, ours = model.state_dict(), back.state_dict()
    assert set(theirs) == set(ours)
    for name, value in theirs.items():
        assert torch.equal(value, ours[name]), name
    tokens = _tokens(2, 24)
    np.testing.assert_array_equal(_hf_logits(back, tokens), _hf_logits(model, tokens))


def test_greedy_generation_equals_transformers_generate(hf_dirs, imported):
    """Same prompt ids, `generate(do_sample=False)` against msjax's cached greedy decoding, for both
    architectures, Llama 3.1's scaled RoPE, Qwen2's biases, Qwen3's query/key norms, Mistral's sliding window,
    Mixtral's, Qwen2-MoE's (with its gated shared expert) and Qwen3-MoE's experts
    (21 tokens through a window of 7; HF stops at no eos here: eos_token_id None)."""
    for kind in ("gpt2", "llama", "llama31", "qwen2", "qwen2-untied", "qwen3", "mistral", "mixtral", "qwen2-moe",
                 "qwen3-moe"):
        _, model = hf_dirs[kind]
        run = load_run(imported[kind].run_dir, overrides=ONE_DEVICE, devices=jax.devices()[:1])
        prompts = [[5, 17, 250, 3, 42], [7, 8]]
        ours = run.generator.generate(prompts, 16, temperature=0)
        for prompt, got in zip(prompts, ours):
            with torch.no_grad():
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
            assert got == ids[0, len(prompt):].tolist(), kind


@pytest.mark.slow
def test_imported_run_resumes_on_another_mesh_and_generates(hf_dirs, tmp_path, small_corpus):
    """scripts/convert.py --from_hf with the training settings (a batch of 8 x 32 tokens from a small corpus), then
    scripts/train.py --config=RUN --resume continues from step 0 (the imported checkpoint) on tensor 2 x data 4
    instead of the import's data 8; its first loss is the cross-entropy of `transformers`' logits on the same
    batch. scripts/generate.py encodes the prompt as `AutoTokenizer` does and decodes as `generate` does."""
    from msjax.config import load_preset
    from msjax.data import BatchLoader, prepare_data

    d, model = hf_dirs["llama"]
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    setup = ["--train.global_batch=8", "--train.seq_len=32", f"--data.paths={small_corpus}",
             f"--data.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run([sys.executable, "scripts/convert.py", f"--from_hf={d}", f"--run_dir={run}", *setup],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_parameters_only_import(run)
    proc = subprocess.run([sys.executable, "scripts/train.py", f"--config={run}", "--resume", "--train.steps=2",
                           "--train.log_every=1", "--train.eval_every=0", "--train.eval_batches=1",
                           "--train.sample_tokens=0", "--train.progress=false", "--mesh.data=4", "--mesh.tensor=2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["start_step"] == 0 and summary["checkpoints"][-1] == 2
    first = [json.loads(line) for line in (run / "ranks" / "rank0.jsonl").read_text().splitlines()][0]
    cfg = load_preset(str(run))
    batch = BatchLoader(prepare_data(cfg.data).train, seq_len=32, global_batch=8, seed=cfg.data.seed,
                        prefetch=0).batch_at(0)
    logits = torch.tensor(_hf_logits(model, np.asarray(batch["inputs"])))
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                             torch.tensor(np.asarray(batch["targets"])).reshape(-1).long())
    assert first["step"] == 1 and abs(first["loss"] - float(want)) < TOL, (first["loss"], float(want))

    # generating from the run: the prompt's ids are those AutoTokenizer gives (Llama-style tokenizer files keep
    # their post-processor), the newest checkpoint is the one training wrote
    loaded = load_run(run, overrides=ONE_DEVICE, devices=jax.devices()[:1])
    prompt = "def split(s):"
    result = generate_text(loaded, [prompt], 8, temperature=0)[0]
    want = transformers.AutoTokenizer.from_pretrained(d)(prompt)["input_ids"]
    assert result.prompt_ids == want and want[0] == 300  # the begin-of-text token leads, as transformers puts it
    assert loaded.step == 2 and len(result.generated_ids) == 8


def _check_parameters_only_import(run: Path) -> None:
    """The import wrote the parameters, step and random key, no optimizer state; training's restore of it gives the
    optimizer state a new run makes (AdamW's zero moments, count 0) on the run's shardings, and the parameters."""
    from msjax.checkpoint import Checkpointer, checkpoint_dir
    from msjax.config import load_preset
    from msjax.layout import resolve
    from msjax.train import _restore
    from msjax.train_step import build_train_program

    cfg = load_preset(str(run))
    program = build_train_program(resolve(cfg, jax.devices(), strict=False))
    ckpt = Checkpointer(cfg.checkpoint, checkpoint_dir(cfg.checkpoint, str(run)), read_only=True)
    try:
        assert ckpt.newest_holds() == {"step", "params", "rng"}
        step, state, loader = _restore(ckpt, program)
    finally:
        ckpt.close()
    fresh = jax.jit(program.optimizer.init)(state["params"])
    assert step == 0 and loader is None
    assert jax.tree.structure(state["opt_state"]) == jax.tree.structure(fresh)
    for got, want, sharding in zip(jax.tree.leaves(state["opt_state"]), jax.tree.leaves(fresh),
                                   jax.tree.leaves(program.state_shardings["opt_state"])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding == sharding


# ---------------------------------------------------------------------------------------------------------------
# A model msjax trained.


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_corpus):
    """A Llama-style model (GQA, untied, no biases) msjax trained for 6 steps with its own BPE tokenizer."""
    from msjax.train import run
    from tests.msjax.tiny_runs import tiny_run_config

    tmp = tmp_path_factory.mktemp("trained")
    cfg = tiny_run_config(tmp, small_corpus, **{
        "model.position": "rope", "model.norm": "rmsnorm", "model.mlp": "swiglu", "model.use_bias": False,
        "model.tie_embeddings": False, "model.num_heads": 4, "model.num_kv_heads": 2, "model.d_ff": 72,
        "data.tokenizer": "bpe", "data.bpe_vocab_size": 300, "train.steps": 6, "optimizer.decay_steps": 6,
        "train.sample_tokens": 0, "checkpoint.every": 6, "model.rope_base": 777.0, "mesh.data": 8, "mesh.fsdp": 1,
        "mesh.tensor": 1})
    summary = run(cfg)
    assert summary.train_loss is not None
    return tmp / "run"


def test_trained_model_exports_loads_in_transformers_and_round_trips_bit_for_bit(trained, tmp_path):
    out = export_hf(trained, tmp_path / "hf")
    assert out.arch == "LlamaForCausalLM" and out.step == 6
    model = transformers.AutoModelForCausalLM.from_pretrained(out.out_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out.out_dir)
    ours_tok = HFTokenizer.from_file(trained / "tokenizer.json")
    text = "for name in sorted(names):\n    yield name  # é"
    assert tok(text)["input_ids"] == ours_tok.encode(text).tolist()
    assert tok.decode(tok(text)["input_ids"]) == text
    run = load_run(trained, overrides=ONE_DEVICE, devices=jax.devices()[:1])
    tokens = np.random.default_rng(3).integers(0, run.config.model.vocab_size, (2, 32)).astype(np.int32)
    np.testing.assert_allclose(_msjax_logits(run, tokens), _hf_logits(model, tokens), atol=TOL, rtol=0)
    # ... and back: the imported checkpoint's parameters are the trained ones, bit for bit
    again = import_hf(out.out_dir, tmp_path / "again", overrides=ONE_DEVICE, devices=jax.devices()[:1])
    back = load_run(again.run_dir, overrides=ONE_DEVICE, devices=jax.devices()[:1])
    want = jax.tree_util.tree_flatten_with_path(jax.device_get(run.generator.params))[0]
    got = dict(jax.tree_util.tree_flatten_with_path(jax.device_get(back.generator.params))[0])
    assert len(want) == len(got)
    for path, value in want:
        np.testing.assert_array_equal(got[path], value, err_msg=jax.tree_util.keystr(path))
    for key in ("position", "norm", "mlp", "rope_base", "num_kv_heads", "d_ff", "tie_embeddings", "use_bias"):
        assert getattr(back.config.model, key) == getattr(run.config.model, key), key


@pytest.mark.parametrize("kind", ["char", "byte"])
def test_char_and_byte_tokenizers_load_in_autotokenizer(tmp_path, kind):
    text = "To be, or not to be:\nthat is the question.  ûñï"
    ours = CharTokenizer.fit([text]) if kind == "char" else ByteTokenizer()
    (tmp_path / "tokenizer.json").write_text(hf_tokenizer_json(ours))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tok(text)["input_ids"]
    assert ids == ours.encode(text).tolist()
    assert tok.decode(ids) == text
    if kind == "byte":
        assert tok.convert_tokens_to_ids("<|endoftext|>") == 256


# ---------------------------------------------------------------------------------------------------------------
# What cannot be converted: one error naming the field or tensor.


def _edited(hf_dirs, tmp_path, kind: str, config=None, drop=None, add=None, rename=None) -> Path:
    d = tmp_path / "hf"
    shutil.copytree(hf_dirs[kind][0], d)
    doc = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**doc, **(config or {})}))
    if drop or add or rename:
        from safetensors.torch import load_file, save_file

        tensors = load_file(d / "model.safetensors")
        for name in drop or ():
            tensors.pop(name)
        tensors.update(add or {})
        for old, new in (rename or {}).items():
            tensors[new] = tensors.pop(old)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("kind, edit, needle", [
    ("llama", dict(config={"architectures": ["GemmaForCausalLM"]}),
     "architectures=['GemmaForCausalLM']; msjax converts GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, "
     "Qwen3ForCausalLM, MistralForCausalLM"),
    ("mistral", dict(config={"sliding_window": 0}), "sliding_window=0; a positive integer or null is needed"),
    ("llama", dict(config={"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}),
     "rope type 'llama3' needs rope_parameters.low_freq_factor; it is missing"),
    ("llama", dict(config={"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5, "factor": 4.0}}),
     "rope_parameters.rope_type / rope_scaling='longrope': msjax's RoPE scales frequencies as 'default', "
     "'linear', 'llama3', 'yarn'"),
    ("llama", dict(config={"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}}),
     "rope type 'yarn' needs rope_parameters.original_max_position_embeddings; it is missing"),
    ("llama", dict(config={"hidden_act": "gelu"}), "hidden_act='gelu' cannot be represented in msjax; allowed: "
                                                    "'silu'"),
    ("llama", dict(config={"attention_bias": True}), "attention_bias=True and mlp_bias=False"),
    ("qwen2", dict(config={"use_sliding_window": True}), "use_sliding_window=True cannot be represented in msjax; "
                                                          "allowed: False"),
    ("qwen3", dict(config={"attention_bias": True}), "attention_bias=True: Qwen3's attention biases without MLP "
                                                     "biases cannot be represented"),
    ("gpt2", dict(config={"activation_function": "relu"}), "activation_function='relu' cannot be represented"),
    ("gpt2", dict(config={"scale_attn_by_inverse_layer_idx": True}), "scale_attn_by_inverse_layer_idx=True"),
    ("llama", dict(drop=["model.layers.1.mlp.up_proj.weight"]),
     "tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
    ("llama", dict(add={"model.layers.0.self_attn.extra.weight": torch.zeros(2)}),
     "tensors msjax has no place for: model.layers.0.self_attn.extra.weight"),
    ("llama", dict(config={"intermediate_size": 90}), "'model.layers.0.mlp.gate_proj.weight' (shape (84, 48)) does "
                                                      "not fit msjax's mlp.w_gate of layer 0"),
    ("gpt2", dict(config={"n_layer": 4}), "tensor 'transformer.h.3.ln_1.weight' is missing"),
    ("mixtral", dict(config={"router_jitter_noise": 0.1}), "router_jitter_noise=0.1 cannot be represented in msjax"),
    ("mixtral", dict(config={"architectures": ["DeepseekV3ForCausalLM"]}),
     "architectures=['DeepseekV3ForCausalLM']; msjax converts GPT2LMHeadModel, LlamaForCausalLM"),
    ("qwen2-moe", dict(config={"mlp_only_layers": [1]}), "mlp_only_layers=[1] cannot be represented in msjax"),
    ("qwen2-moe", dict(config={"shared_expert_intermediate_size": 24}),
     "shared_expert_intermediate_size=24 is not a multiple of moe_intermediate_size=16"),
    ("mixtral", dict(drop=["model.layers.1.block_sparse_moe.experts.5.w3.weight"]),
     "tensor 'model.layers.1.block_sparse_moe.experts.5.w3.weight' is missing"),
])
def test_what_msjax_cannot_represent_is_one_error_naming_it(hf_dirs, tmp_path, kind, edit, needle):
    d = _edited(hf_dirs, tmp_path, kind, **edit)
    with pytest.raises(HFConversionError) as e:
        import_hf(d, tmp_path / "run", overrides=ONE_DEVICE, devices=jax.devices()[:1])
    assert needle in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run.tmp-*"))  # nothing half-made


def test_gpt2_checkpoint_in_the_hub_layout_imports(hf_dirs, tmp_path):
    """The Hub's openai-community/gpt2 files name tensors without `transformer.` and carry the causal-mask buffers
    (`h.i.attn.bias`): the same model, the same logits."""
    d, model = hf_dirs["gpt2"]
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    hub = _edited(hf_dirs, tmp_path, "gpt2", rename={n: n[len("transformer."):] for n in names
                                                     if n.startswith("transformer.")},
                  add={f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 40, 40)) for i in range(3)})
    result = import_hf(hub, tmp_path / "run", overrides=ONE_DEVICE, devices=jax.devices()[:1])
    run = load_run(result.run_dir, overrides=ONE_DEVICE, devices=jax.devices()[:1])
    tokens = _tokens(4, 16)
    np.testing.assert_allclose(_msjax_logits(run, tokens), _hf_logits(model, tokens), atol=TOL, rtol=0)


@pytest.mark.slow
def test_command_line_errors(hf_dirs, imported, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

    def convert(*flags):
        return subprocess.run([sys.executable, "scripts/convert.py", *flags], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    d = hf_dirs["gpt2"][0]
    bins = tmp_path / "bins"
    bins.mkdir()
    shutil.copy(d / "config.json", bins)
    (bins / "pytorch_model.bin").write_bytes(b"")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "x").write_text("")
    for flags, needle in (
        ([f"--from_hf={d}"], "--run_dir is required"),
        ([f"--from_hf={d}", "--to_hf", "--run_dir=x"], "give exactly one of --from_hf=DIR (import) and --to_hf"),
        ([f"--from_hf={tmp_path / 'none'}", "--run_dir=x"], "is not a directory (download one with "
                                                            "`huggingface-cli download"),
        (["--from_hf=hf://openai-community/gpt2", "--run_dir=x"], "--from_hf='hf://openai-community/gpt2' is a URL"),
        ([f"--from_hf={d}", "--run_dir=s3://bucket/run"], "--run_dir='s3://bucket/run' is a URL"),
        ([f"--from_hf={bins}", f"--run_dir={tmp_path / 'r'}"], "found pytorch_model.bin: PyTorch pickles are not read"),
        ([f"--from_hf={d}", f"--run_dir={existing}"], "already exists and is not empty"),
        (["--to_hf", f"--run_dir={imported['gpt2'].run_dir}"], "--to_hf needs --out=DIR"),
        (["--to_hf", f"--run_dir={imported['gpt2'].run_dir}", f"--out={existing}", *[f"--{k}=1" for k in ONE_DEVICE]],
         "--out='" + str(existing) + "' already exists and is not empty"),
    ):
        proc = convert(*flags)
        assert proc.returncode == 2, (flags, proc.stderr[-2000:])
        assert needle in proc.stderr.strip().splitlines()[-1], (flags, proc.stderr[-2000:])


@pytest.mark.parametrize("change, needle", [
    ({"model.block": "parallel"}, "LlamaForCausalLM (chosen by model.position='rope', qkv_bias=False, qk_norm=False, "
                                  "attention.window=None): model.block='parallel' (needs 'serial')"),
    ({"model.mlp": "gelu"}, "LlamaForCausalLM (chosen by model.position='rope', qkv_bias=False, qk_norm=False, "
                            "attention.window=None): model.mlp='gelu' (needs 'swiglu')"),
    ({"model.qkv_bias": True, "model.use_bias": True}, "Qwen2ForCausalLM (chosen by model.position='rope', "
                                                       "qkv_bias=True, qk_norm=False, attention.window=None): "
                                                       "model.use_bias=True (needs False)"),
    ({"model.qk_norm": True, "model.qkv_bias": True}, "Qwen3ForCausalLM (chosen by model.position='rope', "
                                                      "qkv_bias=True, qk_norm=True, attention.window=None): "
                                                      "model.qkv_bias=True (needs False)"),
    ({"model.qk_norm": True, "model.attention.window": 8}, "Qwen3ForCausalLM (chosen by model.position='rope', "
                                                           "qkv_bias=False, qk_norm=True, attention.window=8): "
                                                           "model.attention.window=8 (needs None)"),
    ({"model.attention.window": 8, "model.use_bias": True}, "MistralForCausalLM (chosen by model.position='rope', "
                                                            "qkv_bias=False, qk_norm=False, attention.window=8): "
                                                            "model.use_bias=True (needs False)"),
    ({"model.moe": MoEConfig(num_experts=4, normalize_topk=False)},
     "MixtralForCausalLM (chosen by model.position='rope', qkv_bias=False, qk_norm=False, attention.window=None): "
     "model.moe.normalize_topk=False (needs True)"),
    ({"model.moe": MoEConfig(num_experts=4, shared_experts=1)},
     "Qwen2MoeForCausalLM (chosen by model.position='rope', qkv_bias=False, qk_norm=False, attention.window=None): "
     "model.moe.shared_gate=False (needs True)"),
    ({"model.moe": MoEConfig(num_experts=4, shared_experts=1, shared_gate=True), "model.qk_norm": True},
     "Qwen3MoeForCausalLM (chosen by model.position='rope', qkv_bias=False, qk_norm=True, attention.window=None): "
     "model.moe.shared_experts=1 (needs 0)"),
    ({"model.moe": MoEConfig(num_experts=4), "model.position": "learned", "model.norm": "layernorm",
      "model.mlp": "gelu", "model.use_bias": True, "model.tie_embeddings": True, "model.num_kv_heads": 0},
     "model.moe.num_experts=4 (needs 0)"),
])
def test_models_no_hf_architecture_holds_are_refused_on_export(trained, tmp_path, change, needle):
    from msjax.hf.arch import architecture_for

    m = run_config(trained).model
    fields = {k.split(".")[-1]: v for k, v in change.items()}
    if "window" in fields:
        m = dataclasses.replace(m, attention=dataclasses.replace(m.attention, window=fields.pop("window")))
    m = dataclasses.replace(m, **fields)
    with pytest.raises(HFConversionError, match="cannot be written as ") as e:
        architecture_for(m)
    assert needle in str(e.value), str(e.value)
