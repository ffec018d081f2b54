"""Llama 3.1 8B (Meta, "The Llama 3 Herd of Models", 2024, sec. 3.4.2 and the released config.json): Llama 3 8B's
shape with a 128K context, RoPE base 500,000 with Llama 3.1's frequency scaling (factor 8 around the original
8192-token context; its low/high frequency factors 1 and 4 are msjax's defaults). The same preset serves Llama 3.2 and 3.3 checkpoints of
this shape. For the planner (`scripts/plan.py --config=llama3_1_8b`) and for fine-tuning a converted checkpoint;
the batch and layout stay Llama 3 8B's, 2048 x 8192 on 64 H100s (long-context training is a later stage).
"""

from .llama3_8b import OVERRIDES as LLAMA3_8B

OVERRIDES = {
    **LLAMA3_8B,
    "model.max_seq_len": 131072,
    "model.rope_scaling.type": "llama3",
    "model.rope_scaling.factor": 8.0,
    "model.rope_scaling.original_max_seq_len": 8192,
    "train.run_dir": "runs/llama3_1_8b",
}
