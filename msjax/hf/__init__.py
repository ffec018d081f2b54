"""Hugging Face checkpoints in and out: GPT-2 (`GPT2LMHeadModel`), Llama (`LlamaForCausalLM`, Llama 3.1's RoPE
scaling included), Qwen2/Qwen2.5 (`Qwen2ForCausalLM`), Qwen3 (`Qwen3ForCausalLM`) and Mistral
(`MistralForCausalLM`).

- `arch`: the architectures' config fields and tensors, mapped onto msjax's model (`msjax.model`), and the
  errors for what msjax cannot represent.
- `convert`: a local HF model directory -> an msjax run directory with a verified checkpoint (`import_hf`), and a
  run's newest verified checkpoint -> a HF model directory that `transformers` loads (`export_hf`).
- `tokenizer`: msjax tokenizers as HF tokenizer files.

`scripts/convert.py` is the command line; docs/models.md shows the commands, including getting a model with
`huggingface-cli download`. `transformers` itself checks the results in tests/msjax/test_hf.py (logits both ways,
bit-identical round trips, greedy generation).
"""

from msjax.hf.arch import ARCHITECTURES, GPT2, LLAMA, HFConversionError, architecture_for, model_overrides_from_hf
from msjax.hf.convert import ExportResult, ImportResult, export_hf, import_hf

__all__ = ["ARCHITECTURES", "ExportResult", "GPT2", "HFConversionError", "ImportResult", "LLAMA",
           "architecture_for", "export_hf", "import_hf", "model_overrides_from_hf"]
