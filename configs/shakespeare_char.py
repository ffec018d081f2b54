"""The standard char-level Shakespeare CPU recipe (nanoGPT's `train_shakespeare_char.py` with its README's CPU
flags): 4 layers, 4 heads, width 128, context 64, batch 12, no biases (nanoGPT's `bias = False`), 2000 steps, AdamW
lr 1e-3 -> 1e-4 cosine, beta2 0.99, 100 warmup steps, no dropout, eval every 250 steps over 20 batches; 90/10
train/validation split of the file.

The corpus (Karpathy's tinyshakespeare, 1,115,394 bytes of public-domain Shakespeare) ships inside the package
(msjax/data/corpora/), so the preset runs on a fresh clone or install, from any working directory.
"""

import importlib.resources

CORPUS = importlib.resources.files("msjax") / "data" / "corpora" / "tinyshakespeare.txt"

OVERRIDES = {
    # Stacked layers, loop unrolled: a rolled scan's backward is ~2x a Python loop's on CPU, and per-layer
    # parameters give the optimizer 3x the leaves (each a few small ops); unrolled, the step takes ~5% less.
    "model.scan_unroll": 4,
    "model.d_model": 128,
    # nanoGPT's model as its recipe trains it: train.py's `bias = False` (no biases in the linear layers, LayerNorm
    # without an offset), which neither the config file nor the README's flags change
    "model.use_bias": False,
    "model.max_seq_len": 64,
    # bf16 matmul operands where the backend multiplies bf16 faster (GPU, TPU, AMX CPUs), float32 elsewhere
    "model.matmul_dtype": "auto",
    "model.vocab_multiple": 8,  # 65 characters -> 72 rows: splits over up to 8 tensor-parallel devices (the
    # padding rows' logits are masked to -1e9, so the loss is the same function of the 65 real ones)
    "data.paths": (str(CORPUS),),
    "data.tokenizer": "char",
    "data.val_fraction": 0.1,
    "train.seq_len": 64,
    # 10 steps per call of the compiled step: on XLA:CPU each call costs an idle gap and host dispatch, ~1-2 ms;
    # 19.8 against 22.1 ms per step (docs/cpu_speed.md). Every interval below (and observe's) is a multiple of 10.
    "train.steps_per_execution": 10,
    "train.global_batch": 12,
    "train.steps": 2000,
    "train.eval_every": 250,
    "train.sample_tokens": 300,
    "train.run_dir": "runs/shakespeare_char",
    "optimizer.decay_steps": 2000,
    "checkpoint.every": 1000,
}
