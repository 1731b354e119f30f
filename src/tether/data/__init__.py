"""Records, loading, validation, tokenisation with loss masks, packing and collation."""

from tether.data.loading import load_records, read_rows
from tether.data.packing import (
    PackedSequences,
    make_batches,
    model_inputs,
    pack_bins,
    pack_examples,
    pack_sequences,
    pad_examples,
)
from tether.data.schemas import (
    FORMATS,
    ROLES,
    DataError,
    detect_format,
    format_names,
    split_implicit_prompt,
    validate_records,
)
from tether.data.tokenize import (
    IGNORE_INDEX,
    TokenizedExample,
    tokenize_dataset,
    tokenize_prompt,
    tokenize_prompts,
    tokenize_sft,
    tokenize_text,
)

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "ROLES",
    "DataError",
    "PackedSequences",
    "TokenizedExample",
    "detect_format",
    "format_names",
    "load_records",
    "make_batches",
    "model_inputs",
    "pack_bins",
    "pack_examples",
    "pack_sequences",
    "pad_examples",
    "read_rows",
    "split_implicit_prompt",
    "tokenize_dataset",
    "tokenize_prompt",
    "tokenize_prompts",
    "tokenize_sft",
    "tokenize_text",
    "validate_records",
]
