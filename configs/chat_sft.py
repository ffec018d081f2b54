"""Supervised fine-tuning on chat data, laid over an imported model's run: `--config=runs/NAME,chat_sft`.

JSONL conversations (`--data.paths=chats.jsonl`, one {"messages": [{"role", "content"}, ...]} per line) rendered
with the model's own chat template, the loss on the assistant's tokens only, short examples packed into each
sequence (msjax.data.sft). The recipe is the common one for full fine-tuning of a pretrained model (as
torchtitan's and Hugging Face TRL's SFT defaults): a small constant-ish learning rate after a short warmup, no
weight decay, a few hundred steps. Run with `--resume`, which starts from the imported checkpoint.
"""

OVERRIDES = {
    "data.format": "chat",
    "data.val_fraction": 0.1,
    "optimizer.lr": 2e-5,
    "optimizer.min_lr": 2e-6,
    "optimizer.warmup_steps": 10,
    "optimizer.weight_decay": 0.0,
    "train.steps": 300,
    "train.eval_every": 50,
    "train.sample_tokens": 0,
}
