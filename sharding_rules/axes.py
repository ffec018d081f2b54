"""Logical axis names: the vocabulary shared by the model (which names axes) and the rule sets (which place them).

Parameters (MaxText's names): VOCAB, EMBED, MLP, HEADS, KV_HEADS, HEAD_DIM, LAYERS, NORM, EXP (a mixture of
experts' expert dimension).
Activations carry an `act_` prefix so a rule set can lay out a weight and the activation it produces differently
(e.g. FSDP shards weights over `fsdp` on `embed` but never the activations' model dimension).
"""

# Mesh axes, outer (slowest links) to inner (fastest links). `expert` (expert parallelism) splits a mixture of
# experts' experts and, for everything else, acts as one more data-parallel axis (Megatron-Core's expert-data
# parallelism: the devices of an expert group hold different batch rows).
PIPELINE = "pipeline"
DATA = "data"
FSDP = "fsdp"
EXPERT = "expert"
SEQUENCE = "sequence"
TENSOR = "tensor"
MESH_AXES = (PIPELINE, DATA, FSDP, EXPERT, SEQUENCE, TENSOR)
BATCH_AXES = (DATA, FSDP, EXPERT)  # the mesh axes a step's batch rows are split over

# Parameter axes.
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
LAYERS = "layers"
NORM = "norm"
POSITION = "position"
EXP = "exp"

# Activation axes.
ACT_BATCH = "act_batch"
# The sequence dimension of the residual stream (between tensor-parallel regions), and inside them (queries and
# the MLP hidden state). Megatron sequence parallelism splits the first over `tensor` too; the second cannot
# be, because the heads or MLP columns already are.
ACT_SEQ = "act_seq"
ACT_SEQ_INNER = "act_seq_inner"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_KV_HEADS = "act_kv_heads"
ACT_HEAD_DIM = "act_head_dim"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"

__all__ = [name for name in dir() if name.isupper()]
