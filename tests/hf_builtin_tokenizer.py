"""The built-in vocabulary's transformers tokenizer files in a test's checkpoint directory (written by
`radixk3.hf_tokenizer_writer`, the files radixk3/assets/ ships), so that transformers' `apply_chat_template` can be
compared with radixk3's on the same files."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from radixk3.hf_tokenizer_writer import write_hf_tokenizer


def save_hf_tokenizer(out_dir: Path) -> Path:
    """Write the transformers tokenizer files (tokenizer.json, tokenizer_config.json) into `out_dir`."""
    return write_hf_tokenizer(out_dir)


def load_hf_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(model_dir)
