"""The CPU default: a small GPT on the interpreter's standard-library sources with a byte-level BPE.

Sized so that a 2-core CPU shows validation loss falling within a few minutes (see README for figures).
"""

OVERRIDES = {
    "model.scan_layers": False,  # shallow: a Python loop over layers beats scan ~2x in the backward on CPU
    "model.d_model": 192,
    "model.num_heads": 6,
    "model.max_seq_len": 128,
    "train.seq_len": 128,
    "train.eval_batches": 10,
    "train.run_dir": "runs/gpt_tiny",
    "optimizer.lr": 2e-3,
    "optimizer.min_lr": 2e-4,
    "optimizer.warmup_steps": 50,
    "checkpoint.every": 250,
}
