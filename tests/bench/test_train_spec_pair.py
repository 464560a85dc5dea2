"""bench/train_spec_pair.py on a tiny recipe (a dozen examples, a few steps): the losses fall, the artifact loads
with its MTP layer, two runs give identical bytes, and a second call reuses the cache; `--write-builtin`'s target
(bf16, recipe.json) and the pair trained against a given target; the DSpark agreement drafts as the drafter does."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from bench.spec_pair_agreement import agreement, dspark_first_drafts
from bench.spec_train_dspark import every_anchor_logits, window_anchors
from bench.train_spec_pair import (
    DSparkStage,
    Recipe,
    Stage,
    dspark_config,
    ensure_spec_pair,
    file_sha256,
    k3_config,
    retrain_dspark,
    retrain_mtp,
    served_target,
    write_builtin,
)
from radixk3.checkpoint import load_model, write_checkpoint
from radixk3.dspark import target_aux_states
from radixk3.dspark_checkpoint import build_dspark, load_dspark, write_dspark_checkpoint
from radixk3.model import build_model

TINY = Recipe(
    target=k3_config(32, 2, [2], 1, 32, 64, mtp=1),
    draft=k3_config(16, 2, [2], 1, 16, 32, mtp=0),
    target_stage=Stage(steps=6, lr=2e-2, batch=2),
    mtp_stage=Stage(steps=6, lr=2e-2, batch=2),
    draft_stage=Stage(steps=6, lr=2e-2, batch=2),
    dspark_stage=Stage(steps=2, lr=1e-2, batch=1),
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


def test_write_builtin_then_the_pair_on_it(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`write_builtin` writes the target in bf16 with its recipe.json; the draft and DSpark trained against it are
    cached under a key of the recipe and the target's weights, and the pair's target is the given checkpoint."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = write_builtin(TINY, tmp_path / "k3-gsm8k", log=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "recipe.json",
                                                     "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    target = load_model(out)
    assert target.lm_head.weight.dtype == torch.bfloat16 and len(target.model.mtp_layers) == 1
    report = json.loads((out / "recipe.json").read_text())
    assert report["command"] == "python bench/train_spec_pair.py --write-builtin"
    assert report["data"]["sha256"] == file_sha256(Path("bench/data/gsm8k/train.jsonl"))
    assert set(report["seconds"]) == {"data", "target", "mtp", "draft", "dspark"}
    assert set(report["agreement"]) == {"mtp_top1", "draft_top1", "dspark_top1"}
    assert all(0.0 <= v <= 1.0 for v in report["agreement"].values())

    pair = ensure_spec_pair(recipe=TINY, target=out)  # trained by write_builtin: a cache hit
    assert pair.target == out and not (pair.draft.parent / "target").exists()
    assert pair.draft.parent.name.startswith(TINY.key(Path("bench/data/gsm8k/train.jsonl")) + "-")
    stamp = (pair.draft / "model.safetensors").stat().st_mtime_ns
    assert ensure_spec_pair(recipe=TINY, target=out) == pair
    assert (pair.draft / "model.safetensors").stat().st_mtime_ns == stamp

    # `--retrain-mtp` (stage 2 alone, on the committed target) writes the very bytes `--write-builtin` wrote.
    again = shutil.copytree(out, tmp_path / "again")
    spoilt = load_model(again)
    with torch.no_grad():
        for p in spoilt.model.mtp_layers.parameters():
            p.zero_()
    write_checkpoint(spoilt, again)  # an MTP layer the retraining must replace
    assert (again / "model.safetensors").read_bytes() != (out / "model.safetensors").read_bytes()
    retrain_mtp(TINY, again, log=False)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    redone = json.loads((again / "recipe.json").read_text())
    assert redone["mtp_retrained_by"] == "python bench/train_spec_pair.py --retrain-mtp"
    assert redone["agreement"] == report["agreement"] and redone["final_loss"] == report["final_loss"]


def test_dspark_agreement_drafts_as_the_drafter_does(tmp_path: Path) -> None:
    """The measured first drafts, batched over anchors, equal the drafter's own greedy draft from each anchor
    alone (context [0, L), anchor L, a block of its block size)."""
    pair = ensure_spec_pair(recipe=TINY, cache_dir=tmp_path)
    target = served_target(pair.target)
    drafter = load_dspark(pair.dspark, target)
    ids = torch.arange(100, 160)
    anchors = torch.tensor([1, 2, 7, 30, 58])
    got = dspark_first_drafts(target, drafter, ids, anchors, chunk=2)
    aux = target_aux_states(target, drafter.config, ids, torch.tensor([0, ids.numel()]))
    for n, first in zip(anchors.tolist(), got.tolist(), strict=True):
        with torch.inference_mode():
            ctx = drafter.context_latents(aux[:n], torch.arange(n))
            want = drafter.draft(ctx, torch.tensor([0, n]), ids[n:n + 1]).tokens[0, 0]
        assert first == int(want)
    agree = agreement(target, load_model(pair.draft), ids, drafter)
    assert agree.dspark_top1 is not None and 0.0 <= agree.dspark_top1 <= 1.0


def test_retrain_dspark_changes_only_the_dspark_figures(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`--retrain-dspark` (stage 4 alone, against the committed target): with the recipe `--write-builtin` used it
    makes the very drafter and DSpark figures that run made, replacing the cached pair's drafter; with a changed
    DSpark stage only the DSpark figures of recipe.json change, the checkpoint's bytes stay, and no pair is cached
    under the new recipe's key (the first bench run trains it)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    out = write_builtin(TINY, tmp_path / "k3-gsm8k", log=False)
    before = json.loads((out / "recipe.json").read_text())
    checkpoint = (out / "model.safetensors").read_bytes()
    pair = ensure_spec_pair(recipe=TINY, target=out)  # trained by write_builtin: a cache hit
    drafter = (pair.dspark / "model.safetensors").read_bytes()
    spoilt = load_dspark(pair.dspark, served_target(out))
    with torch.no_grad():
        for p in spoilt.parameters():
            p.zero_()
    write_dspark_checkpoint(spoilt, pair.dspark)  # a drafter the retraining must replace
    assert (pair.dspark / "model.safetensors").read_bytes() != drafter

    def without(report: dict, *keys: str) -> dict:
        return {k: ({n: x for n, x in v.items() if n not in keys} if isinstance(v, dict) else v)
                for k, v in report.items() if k not in keys}

    retrain_dspark(TINY, out, log=False)
    assert (pair.dspark / "model.safetensors").read_bytes() == drafter
    same = json.loads((out / "recipe.json").read_text())
    assert same["dspark_retrained_by"] == "python bench/train_spec_pair.py --retrain-dspark"
    timing = ("dspark_retrained_by", "train_seconds", "dspark")
    assert without(same, *timing)["seconds"] == without(before, *timing)["seconds"]
    assert without(same, "dspark_retrained_by", "train_seconds", "seconds") == without(before, "train_seconds",
                                                                                       "seconds")

    changed = dataclasses.replace(TINY, dspark_stage=DSparkStage(steps=3, lr=1e-2, batch=1, window=64, anchors=8))
    retrain_dspark(changed, out, log=False)
    assert (out / "model.safetensors").read_bytes() == checkpoint
    after = json.loads((out / "recipe.json").read_text())
    assert after["recipe"]["dspark_stage"] == {"steps": 3, "lr": 1e-2, "batch": 1, "window": 64, "anchors": 8}
    assert after["final_loss"]["dspark"] != before["final_loss"]["dspark"]
    figures = ("dspark_retrained_by", "train_seconds", "dspark", "dspark_top1", "dspark_stage")
    assert without(after, *figures) == without(before, *figures)
    key = changed.key(Path("bench/data/gsm8k/train.jsonl"))
    assert not any(p.name.startswith(key) for p in (cache / "radixk3" / "spec_pair").iterdir())


def test_every_anchor_pass_equals_the_drafters_own_block() -> None:
    """The trainer's one pass over a window's anchors (every anchor, or a drawn few) gives each anchor's block
    the base logits `draft_block` gives it on that prefix alone."""
    target = build_model(TINY.target, seed=0).eval()
    drafter = build_dspark(dspark_config(TINY.target).replace(dtype="float32"), target, seed=0)
    ids = torch.arange(200, 260)
    aux = target_aux_states(target, drafter.config, ids, torch.tensor([0, ids.numel()])).clone()
    drawn = window_anchors(ids.numel(), 7, torch.Generator().manual_seed(0))
    assert drawn.numel() == 7 and drawn.unique().numel() == 7 and 1 <= drawn.min() and drawn.max() < 59
    assert torch.equal(window_anchors(ids.numel(), None, None), torch.arange(1, 59))
    with torch.no_grad():
        got = every_anchor_logits(drafter, drafter.context_latents(aux, torch.arange(ids.numel())), ids, drawn)
        for n, row in zip(drawn.tolist(), got, strict=True):
            ctx = drafter.context_latents(aux[:n], torch.arange(n))
            want = drafter.draft_block(ctx, torch.tensor([0, n]), ids[n:n + 1]).logits[0]
            torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)
