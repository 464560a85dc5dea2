"""Trains the built-in sentencepiece BPE from the gsm8k training text, deterministically and in memory.

    python -m radixk3.tokenizer_train            # rewrite radixk3/assets/tokenizer.model
    python -m radixk3.tokenizer_train --check    # exit 1 unless a fresh training matches the shipped file

One thread, no shuffling and no sentence sampling make the output byte-identical across runs (for one
sentencepiece version).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from radixk3.tokenizer import BOS_ID, BUILTIN_MODEL, EOS_ID, PAD_ID, UNK_ID, USER_SYMBOLS

GSM8K_TRAIN = Path(__file__).resolve().parents[1] / "bench" / "data" / "gsm8k" / "train.jsonl"


@dataclass(frozen=True)
class TokenizerTrainConfig:
    vocab_size: int = 4096
    # Single digits keep every number's tokens aligned with its decimal digits, which arithmetic needs.
    split_digits: bool = True
    # Every training character gets a piece; anything unseen falls back to bytes.
    character_coverage: float = 1.0


def gsm8k_texts(path: Path = GSM8K_TRAIN) -> Iterator[str]:
    """Question then answer of every row of a gsm8k jsonl file, in file order."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            yield row["question"]
            yield row["answer"]


def train_tokenizer(texts: Iterable[str], config: TokenizerTrainConfig = TokenizerTrainConfig()) -> bytes:
    """The serialized sentencepiece model trained on `texts`."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=out,
        model_type="bpe",
        vocab_size=config.vocab_size,
        character_coverage=config.character_coverage,
        split_digits=config.split_digits,
        # Exact round trips: no normalisation, no dummy prefix, whitespace kept as written.
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        byte_fallback=True,
        user_defined_symbols=list(USER_SYMBOLS),
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_piece="<pad>",
        unk_piece="<unk>",
        bos_piece="<s>",
        eos_piece="</s>",
        # Determinism.
        num_threads=1,
        shuffle_input_sentence=False,
        input_sentence_size=0,
        minloglevel=2,
    )
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=GSM8K_TRAIN, help="gsm8k train.jsonl")
    parser.add_argument("--out", type=Path, default=BUILTIN_MODEL, help="where to write the model")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    model = train_tokenizer(gsm8k_texts(args.data))
    if args.check:
        same = args.out.is_file() and args.out.read_bytes() == model
        print(f"{args.out}: {'matches' if same else 'DIFFERS from'} a fresh training ({len(model)} bytes)")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(model)
    print(f"wrote {args.out} ({len(model)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
