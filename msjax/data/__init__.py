"""Data: corpus files -> tokenizer -> memory-mapped token cache -> prefetched global batches.

    datasets = prepare_data(cfg.data)                       # tokenize once per corpus+config, then mmap
    loader = BatchLoader(datasets.train, seq_len=T, global_batch=B, seed=s, sharding=batch_sharding)
    evals = eval_batches(datasets.val, seq_len=T, batch=B, num_batches=n, seed=s, sharding=batch_sharding)
"""

from msjax.data.corpus import (DataError, DataWarning, check_data_paths, read_documents, resolve_files,
                               stdlib_corpus_files)
from msjax.data.loader import BatchLoader, eval_batches
from msjax.data.tokenizer import (TOKENIZER_FILE, ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer,
                                  build_tokenizer, load_tokenizer)
from msjax.data.tokens import Datasets, prepare_data

__all__ = [
    "BatchLoader", "ByteTokenizer", "CharTokenizer", "DataError", "DataWarning", "Datasets", "HFTokenizer",
    "TOKENIZER_FILE", "Tokenizer", "build_tokenizer", "check_data_paths", "eval_batches", "load_tokenizer",
    "prepare_data", "read_documents", "resolve_files", "stdlib_corpus_files",
]
