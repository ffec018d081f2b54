"""Data: corpus files -> tokenizer -> memory-mapped token cache -> prefetched global batches.

    datasets = prepare_data(cfg.data)                       # tokenize once per corpus+config, then mmap
    loader = BatchLoader(datasets.train, seq_len=T, global_batch=B, seed=s, sharding=batch_sharding)
    evals = eval_batches(datasets.val, seq_len=T, batch=B, num_batches=n, seed=s, sharding=batch_sharding)

Supervised fine-tuning (data.format=chat): JSONL conversations -> chat template -> assistant-masked ids -> packed
rows, which the same loader batches (five keys: inputs, targets, weights, segments, positions):

    chat_data = prepare_chat_data(cfg.data, seq_len=T)
    loader = BatchLoader(chat_data.train, seq_len=T, global_batch=B, seed=s, sharding=batch_sharding)
"""

from msjax.data.corpus import (DataError, DataWarning, check_data_paths, read_documents, resolve_files,
                               stdlib_corpus_files)
from msjax.data.loader import BatchLoader, eval_batches, row_indices
from msjax.data.sft import (ChatDatasets, ChatExample, PackedRows, assistant_tokens, pack_examples,
                            prepare_chat_data, read_chat_file)
from msjax.data.tokenizer import (TOKENIZER_FILE, ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer,
                                  build_tokenizer, load_tokenizer)
from msjax.data.tokens import Datasets, prepare_data

__all__ = [
    "BatchLoader", "ByteTokenizer", "CharTokenizer", "ChatDatasets", "ChatExample", "DataError", "DataWarning",
    "Datasets", "HFTokenizer", "PackedRows", "TOKENIZER_FILE", "Tokenizer", "assistant_tokens", "build_tokenizer",
    "check_data_paths", "eval_batches", "load_tokenizer", "pack_examples", "prepare_chat_data", "prepare_data",
    "read_chat_file", "read_documents", "resolve_files", "row_indices", "stdlib_corpus_files",
]
