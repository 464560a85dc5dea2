"""The DSpark drafter: config refusals, checkpoint round trip, aux states and context latents against naive
recomputations, block non-causality, the paged (cached) pass and causal=False paged MLA against plain torch
references, the Markov draft, and training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.spec_train_dspark import draw_samples, dspark_loss, target_data, train_dspark
from kernels.backend import ENV_VAR
from kernels.mla_paged import mla_paged_prefill, mla_store
from kernels.paged_kv import PagedKV, paged_slots
from radixk3.checkpoint import CheckpointError
from radixk3.config import ConfigError, preset
from radixk3.dspark import (
    DSparkModel,
    allocate_dspark_cache,
    aux_request,
    concat_aux,
    store_context,
    target_aux_states,
)
from radixk3.dspark_checkpoint import build_dspark, load_dspark, write_random_dspark
from radixk3.dspark_config import DSparkConfig, k3_tiny_dspark_preset
from radixk3.model import KimiForCausalLM, build_model


@pytest.fixture(scope="module")
def target() -> KimiForCausalLM:
    return build_model(preset("k3-tiny-native"), seed=1)


@pytest.fixture(scope="module")
def drafter(target: KimiForCausalLM) -> DSparkModel:
    return build_dspark(k3_tiny_dspark_preset(), target, seed=2)


def packed_context(model: DSparkModel, target: KimiForCausalLM, lens: list[int], seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Random texts of `lens` tokens: (their ids, cu_seqlens, per-layer context latents)."""
    ids = torch.randint(0, 4096, (sum(lens),), generator=torch.Generator().manual_seed(seed))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        ctx = model.context_latents(target_aux_states(target, model.config, ids, cu), pos)
    return ids, cu, ctx


# --- config -------------------------------------------------------------------------------------------
def test_config_round_trip() -> None:
    cfg = k3_tiny_dspark_preset()
    raw = json.loads(json.dumps(cfg.to_hf_dict()))
    assert raw["model_type"] == "k3_dspark" and raw["target_layer_ids"] == [1, 3]
    assert DSparkConfig.from_hf_dict(raw) == cfg


@pytest.mark.parametrize(("change", "match"), [
    ({"mla_use_nope": True}, "mla_use_nope"),
    ({"mla_use_output_gate": True}, "mla_use_output_gate"),
    ({"mla_use_qk_norm": True}, "mla_use_qk_norm"),
    ({"dspark_bonus_anchor": True}, "dspark_bonus_anchor"),
    ({"sample_from_anchor": False}, "sample_from_anchor"),
    ({"enable_confidence_head": True}, "confidence"),
    ({"draft_vocab_size": 4000}, "draft_vocab_size"),
    ({"target_layer_ids": [1, 4]}, "target_layer_ids"),
    ({"target_layer_ids": [2, 2]}, "target_layer_ids"),
    ({"dspark_noise_token_id": 4096}, "noise"),
    ({"qk_rope_head_dim": 7}, "even"),
    ({"model_type": "deepseek_v3"}, "model_type"),
    ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
    ({"mystery_key": 1}, "mystery_key"),
])
def test_config_refusals(change: dict[str, object], match: str) -> None:
    raw = k3_tiny_dspark_preset().to_hf_dict() | change
    with pytest.raises(ConfigError, match=match):
        DSparkConfig.from_hf_dict(raw)


def test_config_missing_field_and_target_mismatch(target: KimiForCausalLM) -> None:
    raw = k3_tiny_dspark_preset().to_hf_dict()
    del raw["markov_rank"]
    with pytest.raises(ConfigError, match="markov_rank"):
        DSparkConfig.from_hf_dict(raw)
    with pytest.raises(ConfigError, match="num_target_layers"):
        DSparkModel(k3_tiny_dspark_preset().replace(num_target_layers=5), target)


# --- checkpoint -----------------------------------------------------------------------------------------
def test_checkpoint_round_trip(tmp_path: Path, target: KimiForCausalLM, drafter: DSparkModel) -> None:
    out = write_random_dspark(tmp_path / "d", target, seed=2)
    names = set(load_file(out / "model.safetensors"))
    assert "model.markov_w1.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)  # aliased from the target
    loaded = load_dspark(out, target)
    for (k, a), (k2, b) in zip(sorted(drafter.state_dict().items()), sorted(loaded.state_dict().items()),
                               strict=True):
        assert k == k2 and torch.equal(a, b), k
    # A stored embedding or lm_head is ignored; an unknown tensor or a missing one is refused.
    tensors = load_file(out / "model.safetensors")
    save_file(tensors | {"lm_head.weight": torch.zeros(4096, 64)}, out / "model.safetensors")
    load_dspark(out, target)
    save_file(tensors | {"model.extra.weight": torch.zeros(1)}, out / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.extra.weight'"):
        load_dspark(out, target)
    save_file({k: v for k, v in tensors.items() if k != "model.context_proj.weight"}, out / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor 'model.context_proj.weight'"):
        load_dspark(out, target)


# --- aux states and context latents -----------------------------------------------------------------------
def test_aux_states_are_attn_res_partial_sums(target: KimiForCausalLM) -> None:
    """p after layer i = the sum of layer outputs a_l + m_l of i's block so far (block size 3: layers 0-2, 3)."""
    outs: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(target.model.layers):
        ffn = layer.block_sparse_moe if layer.is_moe else layer.mlp
        for kind, mod in (("a", layer.self_attn), ("m", ffn)):
            hooks.append(mod.register_forward_hook(lambda _m, _i, o, key=(i, kind): outs.__setitem__(key, o)))
    ids = torch.randint(0, 4096, (9,), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 9])
    aux = aux_request(k3_tiny_dspark_preset().replace(target_layer_ids=(0, 1, 2, 3)))
    target.prenorm_hidden(ids, cu, None, aux)
    for h in hooks:
        h.remove()
    for i, first in ((0, 0), (1, 0), (2, 0), (3, 3)):
        ref = sum(outs[(j, "a")] + outs[(j, "m")] for j in range(first, i + 1))
        torch.testing.assert_close(aux[i], ref, rtol=1e-5, atol=1e-5)


def test_aux_states_of_an_additive_target() -> None:
    t = build_model(preset("k3-tiny"), seed=4)
    ids = torch.randint(0, 4096, (7,), generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 7])
    aux = {1: torch.empty(0), 3: torch.empty(0)}
    h = t.prenorm_hidden(ids, cu, None, aux)
    assert torch.equal(aux[3], h)  # the residual stream after the last layer is the pre-norm hidden state
    with torch.no_grad():
        x = t.model.embed_tokens(ids)
        for layer in t.model.layers[:2]:
            x = layer(x, cu, None)
    torch.testing.assert_close(aux[1], x, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not captured"):
        concat_aux(k3_tiny_dspark_preset(), {1: aux[1]})


def naive_rope(x: torch.Tensor, p: int, theta: float) -> torch.Tensor:
    """One position, pair by pair as complex numbers."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        z = complex(float(x[..., 2 * i]), float(x[..., 2 * i + 1])) * complex(
            math.cos(p * theta ** (-2 * i / d)), math.sin(p * theta ** (-2 * i / d)))
        out[..., 2 * i], out[..., 2 * i + 1] = z.real, z.imag
    return out


def test_context_latent_equals_naive_per_position(drafter: DSparkModel) -> None:
    cfg = drafter.config
    aux = torch.randn(6, cfg.aux_dim, generator=torch.Generator().manual_seed(6))
    pos = torch.tensor([0, 1, 2, 3, 40, 1000])
    with torch.no_grad():
        lats = drafter.context_latents(aux, pos)
        for t in range(6):
            c = drafter.context_proj.weight @ aux[t]
            c = c / torch.sqrt(c.pow(2).mean() + cfg.rms_norm_eps) * drafter.context_norm.weight
            for layer, lat in zip(drafter.layers, lats, strict=True):
                attn = layer.self_attn
                kv = attn.kv_a_proj_with_mqa.weight @ c
                ckv, kpe = kv[: cfg.kv_lora_rank], kv[cfg.kv_lora_rank:]
                ckv = ckv / torch.sqrt(ckv.pow(2).mean() + cfg.rms_norm_eps) * attn.kv_a_layernorm.weight
                ref = torch.cat([ckv, naive_rope(kpe, int(pos[t]), cfg.rope_theta)])
                torch.testing.assert_close(lat[t], ref, rtol=1e-5, atol=1e-5)


# --- the block ------------------------------------------------------------------------------------------
def test_block_is_non_causal(drafter: DSparkModel, target: KimiForCausalLM) -> None:
    """The anchor's logits depend on the noise tokens after it (a causal block would not), and on the context."""
    _, cu, ctx = packed_context(drafter, target, [5, 8], 7)
    anchors = torch.tensor([11, 12])
    with torch.no_grad():
        base = drafter.draft_block(ctx, cu, anchors).logits
        cfg = drafter.config
        drafter.config = cfg.replace(dspark_noise_token_id=9)
        try:
            other = drafter.draft_block(ctx, cu, anchors).logits
        finally:
            drafter.config = cfg
        _, _, ctx2 = packed_context(drafter, target, [5, 8], 8)
        other_ctx = drafter.draft_block(ctx2, cu, anchors).logits
    assert base.shape == (2, cfg.block_size, 4096)
    assert (base[:, 0] - other[:, 0]).abs().max() > 1e-3
    assert (base - other_ctx).abs().max() > 1e-3


def test_sequences_in_a_pack_are_independent(drafter: DSparkModel, target: KimiForCausalLM) -> None:
    ids, cu, ctx = packed_context(drafter, target, [5, 8], 9)
    anchors = torch.tensor([11, 12])
    with torch.no_grad():
        both = drafter.draft_block(ctx, cu, anchors).logits
        alone = drafter.draft_block([c[5:] for c in ctx], torch.tensor([0, 8]), anchors[1:]).logits
    torch.testing.assert_close(both[1:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("page_size", "block"), [(1, None), (4, None), (4, 6), (1, 2)])
def test_paged_block_equals_reference(drafter: DSparkModel, target: KimiForCausalLM, page_size: int,
                                      block: int | None) -> None:
    """Also at block lengths other than the trained one (the engine drafts k > block_size in one pass)."""
    lens, b = [5, 8], block or drafter.config.block_size
    _, cu, ctx = packed_context(drafter, target, lens, 10)
    anchors = torch.tensor([11, 12])
    pages = [(n + b + page_size - 1) // page_size for n in lens]
    order = torch.randperm(sum(pages) + 2, generator=torch.Generator().manual_seed(11))
    table = torch.zeros(2, max(pages), dtype=torch.int64)
    table[0, : pages[0]], table[1, : pages[1]] = order[: pages[0]], order[pages[0]: sum(pages)]
    cache = allocate_dspark_cache(drafter.config, (sum(pages) + 2) * page_size)
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    store_context(cache, ctx, paged_slots(table, seq, pos, page_size))
    with torch.no_grad():
        ref = drafter.draft_block(ctx, cu, anchors, block)
        got = drafter.draft_block_paged(anchors, cache, table, torch.tensor(lens), page_size, block)
    assert got.logits.shape == (2, b, drafter.config.vocab_size)
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-4)


# --- causal=False paged MLA -----------------------------------------------------------------------------
def plain_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, w: torch.Tensor, r: int,
                    scale: float, causal: bool) -> torch.Tensor:
    """Softmax attention of one sequence's last q tokens over its kv rows, k/v expanded from kv_b."""
    t, h, dn = q_nope.shape
    wk = w.view(h, -1, r)
    k = torch.cat([torch.einsum("sr,hdr->hsd", lat[:, :r], wk[:, :dn]),
                   lat[None, :, r:].expand(h, -1, -1)], dim=-1)
    v = torch.einsum("sr,hdr->hsd", lat[:, :r], wk[:, dn:])
    scores = torch.einsum("thd,hsd->hts", torch.cat([q_nope, q_pe], -1), k) * scale
    if causal:
        n = lat.shape[0]
        scores = scores.masked_fill(torch.arange(n)[None, :] > (n - t + torch.arange(t))[:, None], float("-inf"))
    return torch.einsum("hts,hsd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_prefill_non_causal(monkeypatch: pytest.MonkeyPatch, backend: str, causal: bool) -> None:
    monkeypatch.setenv(ENV_VAR, backend)
    h, dn, dr, dv, r, page = 2, 8, 4, 8, 16, 4
    kv_lens, q_lens = [9, 3, 14], [4, 3, 2]
    gen = torch.Generator().manual_seed(12)
    pages = [(n + page - 1) // page for n in kv_lens]
    order = torch.randperm(sum(pages) + 1, generator=gen)
    table = torch.zeros(3, max(pages), dtype=torch.int64)
    start = 0
    for i, p in enumerate(pages):
        table[i, :p] = order[start: start + p]
        start += p
    buf = torch.zeros((sum(pages) + 1) * page, r + dr)
    lats = [torch.randn(n, r + dr, generator=gen) for n in kv_lens]
    for i, lat in enumerate(lats):
        p = torch.arange(len(lat))
        mla_store(buf, paged_slots(table, torch.full_like(p, i), p, page), lat)
    t = sum(q_lens)
    q_nope, q_pe = torch.randn(t, h, dn, generator=gen), torch.randn(t, h, dr, generator=gen)
    w = torch.randn(h * (dn + dv), r, generator=gen) / r**0.5
    cu_q = torch.tensor([0, 4, 7, 9])
    scale = (dn + dr) ** -0.5
    o = mla_paged_prefill(q_nope, q_pe, buf, w, PagedKV(table, torch.tensor(kv_lens), page), cu_q=cu_q,
                          scale=scale, causal=causal)
    for i in range(3):
        sl = slice(int(cu_q[i]), int(cu_q[i + 1]))
        ref = plain_attention(q_nope[sl], q_pe[sl], lats[i], w, r, scale, causal)
        torch.testing.assert_close(o[sl], ref, rtol=0, atol=1e-4)
        other = plain_attention(q_nope[sl], q_pe[sl], lats[i], w, r, scale, not causal)
        assert (o[sl][0] - other[0]).abs().max() > 1e-4  # the first query of each sequence sees a different set


# --- the Markov head --------------------------------------------------------------------------------------
def test_markov_greedy_draft(drafter: DSparkModel, target: KimiForCausalLM) -> None:
    _, cu, ctx = packed_context(drafter, target, [6, 3], 13)
    anchors = torch.tensor([100, 200])
    with torch.no_grad():
        base = drafter.draft_block(ctx, cu, anchors).logits
        d1 = drafter.markov_draft(base, anchors)
        d2 = drafter.draft(ctx, cu, anchors)
        prev = anchors
        for i in range(drafter.config.block_size):
            step = base[:, i].float() + drafter.markov_w2(drafter.markov_w1(prev))
            assert torch.equal(d1.tokens[:, i], step.argmax(-1))
            torch.testing.assert_close(d1.probs[:, i], step.softmax(-1))
            prev = d1.tokens[:, i]
        s1 = drafter.markov_draft(base, anchors, greedy=False, generator=torch.Generator().manual_seed(0))
        s2 = drafter.markov_draft(base, anchors, greedy=False, generator=torch.Generator().manual_seed(0))
    assert torch.equal(d1.tokens, d2.tokens) and torch.equal(d1.probs, d2.probs)
    assert d1.tokens.shape == (2, drafter.config.block_size)
    assert torch.equal(s1.tokens, s2.tokens)
    torch.testing.assert_close(d1.probs.sum(-1), torch.ones(2, drafter.config.block_size))


# --- training ------------------------------------------------------------------------------------------
def test_train_dspark_lowers_the_loss(target: KimiForCausalLM) -> None:
    gen = torch.Generator().manual_seed(14)
    texts = [torch.randint(0, 4096, (32,), generator=gen).tolist() for _ in range(3)]
    cfg = k3_tiny_dspark_preset()
    data = target_data(target, cfg, texts, 64)
    held = draw_samples(data, 16, torch.Generator().manual_seed(15))
    losses: list[float] = []
    trained = train_dspark(target, texts, seed=0, steps=25, batch_size=8, losses=losses)
    again = train_dspark(target, texts, seed=0, steps=2, batch_size=8)
    first = train_dspark(target, texts, seed=0, steps=2, batch_size=8)
    untrained = build_dspark(cfg, target, seed=0)
    with torch.no_grad():
        before = float(dspark_loss(untrained, data, held))
        after = float(dspark_loss(trained, data, held))
    assert after < before - 0.1, (before, after, losses)
    for a, b in zip(again.parameters(), first.parameters(), strict=True):
        assert torch.equal(a, b)  # seeded: deterministic
    assert all(p.grad is None for p in target.parameters())  # the target is frozen


def test_aux_states_in_the_cached_path(target: KimiForCausalLM) -> None:
    """forward_batch's aux holds the step's new tokens' states, equal to the no-cache forward's at those positions."""
    from radixk3.forward_batch import ForwardBatch, HybridCache

    cfg = k3_tiny_dspark_preset()
    ids = torch.randint(0, 4096, (8,), generator=torch.Generator().manual_seed(16)).tolist()
    full = target_aux_states(target, cfg, torch.tensor(ids), torch.tensor([0, 8]))
    cache = HybridCache.allocate(target.config, 2, 16)
    target.forward_batch(ForwardBatch.build([ids[:5]], [0], [1], [list(range(5))]), cache)
    aux = aux_request(cfg)
    target.forward_batch(ForwardBatch.build([ids[5:]], [5], [1], [list(range(8))]), cache, aux)
    torch.testing.assert_close(concat_aux(cfg, aux), full[5:], rtol=1e-4, atol=1e-4)


def test_make_checkpoint_writes_the_tiny_drafter(tmp_path: Path, target: KimiForCausalLM) -> None:
    from radixk3.cli import main

    assert main(["make-checkpoint", str(tmp_path / "d"), "--preset", "k3-tiny-dspark", "--seed", "2"]) == 0
    loaded = load_dspark(tmp_path / "d", target)
    assert loaded.config == k3_tiny_dspark_preset()
    ref = build_dspark(k3_tiny_dspark_preset(), target, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), ref.parameters(), strict=True))
