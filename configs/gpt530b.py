"""MegaScale's 530B (Jiang et al., NSDI'24, sec. 6): 105 layers, hidden 20480, 160 heads, sequence 2048,
vocabulary 64,000, LAMB, parallel transformer blocks; TP 8 x PP 35 (3 layers a stage), the rest data parallel.

MegaScale's weak-scaling runs (Fig. 9) put it on 2,240, 4,480 and 11,200 A100s with a batch of one sequence per GPU
(`scripts/plan.py --config=gpt530b --devices=2240 --hardware=a100-80g --global_batch=2240 --mesh.tensor=8
--mesh.pipeline=35`). No remat is the preset's preference and does not fit there (the stash of 141 one-layer slots:
79.4 GiB of 76 on 2,240), so the planner and the trainer's pre-flight check take the cheapest policy that fits and
say so (`dots`, 46.4 GiB); `--model.remat` pins one.
"""

OVERRIDES = {
    "model.vocab_size": 64000,
    "model.num_layers": 105,
    "model.d_model": 20480,
    "model.num_heads": 160,
    "model.max_seq_len": 2048,
    "model.block": "parallel",
    "model.dtype": "bfloat16",
    "data.bpe_vocab_size": 64000,
    "mesh.tensor": 8,
    "mesh.pipeline": 35,
    "optimizer.name": "lamb",
    "optimizer.lr": 6e-5,
    "optimizer.min_lr": 6e-6,
    "optimizer.b2": 0.95,
    "optimizer.warmup_steps": 2000,
    "train.seq_len": 2048,
    "train.global_batch": 6720,
    "train.steps": 100000,
    "train.run_dir": "runs/gpt530b",
}
