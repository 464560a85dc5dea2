"""bench/train_spec_pair.py on a tiny recipe (a dozen examples, a few steps): the losses fall, the artifact loads
with its MTP layer, two runs give identical bytes, and a second call reuses the cache."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.train_spec_pair import Recipe, Stage, agreement, ensure_spec_pair, k3_config
from radixk3.checkpoint import load_model

TINY = Recipe(
    target=k3_config(32, 2, [2], 1, 32, 64, mtp=1),
    draft=k3_config(16, 2, [2], 1, 16, 32, mtp=0),
    target_stage=Stage(steps=6, lr=2e-2, batch=2),
    mtp_stage=Stage(steps=6, lr=2e-2, batch=2),
    draft_stage=Stage(steps=6, lr=2e-2, batch=2),
    dspark_steps=2,
    dspark_texts=4,
    seq_len=32,
    num_examples=12,
)


def weights(pair_dir: Path) -> dict[str, bytes]:
    return {str(f.relative_to(pair_dir)): f.read_bytes() for f in sorted(pair_dir.rglob("*.safetensors"))}


def test_tiny_recipe_trains_loads_is_deterministic_and_cached(tmp_path: Path) -> None:
    pair = ensure_spec_pair(recipe=TINY, cache_dir=tmp_path / "a")
    root = pair.target.parent
    assert root.parent == tmp_path / "a" and root.name == TINY.key(Path("bench/data/gsm8k/train.jsonl"))
    assert not any(p.name.startswith(".tmp") for p in root.parent.iterdir())  # published by rename
    report = json.loads((root / "report.json").read_text())
    for stage in ("target", "mtp", "draft"):
        assert report["final_loss"][stage] < report["first_loss"][stage] - 0.3, stage

    target, draft = load_model(pair.target), load_model(pair.draft)
    assert target.config.model_type == "kimi_k3" and target.config.num_nextn_predict_layers == 1
    assert len(target.model.mtp_layers) == 1 and draft.config.num_nextn_predict_layers == 0
    assert target.config.vocab_size == draft.config.vocab_size == 4096
    ids = torch.arange(5, 40)
    agree = agreement(target, draft, ids)
    assert 0.0 <= agree.mtp_top1 <= 1.0 and 0.0 <= agree.draft_top1 <= 1.0

    again = ensure_spec_pair(recipe=TINY, cache_dir=tmp_path / "b")  # a fresh cache: trains again
    assert weights(root) == weights(again.target.parent)
    assert (pair.dspark is None) == (again.dspark is None)

    stamp = (pair.target / "model.safetensors").stat().st_mtime_ns
    reused = ensure_spec_pair(recipe=TINY, cache_dir=tmp_path / "a")
    assert reused == pair and (pair.target / "model.safetensors").stat().st_mtime_ns == stamp

    changed = TINY.scaled(0.5)
    assert changed.key(Path("bench/data/gsm8k/train.jsonl")) != root.name  # a changed recipe rebuilds
