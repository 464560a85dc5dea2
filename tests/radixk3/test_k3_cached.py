"""k3-tiny-native with every K3 feature on, through the runtime's cache interfaces (`ForwardBatch`, `HybridCache`:
KDA state [H, K, V] + conv state per slot, MLA latent per KV slot): prefill then decode equals the full forward."""

from __future__ import annotations

import torch

from radixk3.config import preset
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM, build_model
from radixk3.mtp import allocate_mtp_cache, token_positions
from tests.greedy import greedy_cached, greedy_reference

TOL = 1e-5


def _model() -> KimiForCausalLM:
    model = build_model(preset("k3-tiny-native"), seed=7)
    cfg = model.config
    assert cfg.kda_full_rank_gate and cfg.kda_gate_lower_bound is not None and cfg.mla_use_output_gate
    assert cfg.attn_res_block_size is not None and cfg.latent_moe_use_norm and cfg.hidden_act == "situ"
    assert cfg.q_lora_rank is not None and cfg.num_nextn_predict_layers == 1
    return model


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_cache_is_the_runtime_layout() -> None:
    cfg = _model().config
    cache = HybridCache.allocate(cfg, num_state_slots=2, num_kv_slots=8)
    assert len(cache.recurrent) == len(cache.conv) == cfg.num_kda_layers and len(cache.latent) == cfg.num_mla_layers
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    assert cache.recurrent[0].shape == (2, h, d, d) and cache.recurrent[0].dtype == torch.float32
    assert cache.conv[0].shape == (2, 3 * h * d, cfg.conv_kernel_size - 1)
    assert cache.latent[0].shape == (8, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_prefill_then_decode_matches_full_forward() -> None:
    model = _model()
    cfg = model.config
    ids = _ids(90, 1)
    full = model(torch.tensor(ids))
    n = 70
    cache = HybridCache.allocate(cfg, num_state_slots=3, num_kv_slots=200)
    slots = [199 - 2 * i for i in range(len(ids))]  # non-contiguous, so the paging is exercised
    got = [model.forward_batch(ForwardBatch.build([ids[:n]], [0], [2], [slots[:n]], all_logits=True), cache)]
    for t in range(n, len(ids)):
        step = ForwardBatch.build([[ids[t]]], [t], [2], [slots[: t + 1]])
        assert step.mode is ForwardMode.DECODE
        got.append(model.forward_batch(step, cache))
    assert (torch.cat(got) - full).abs().max().item() < TOL


def test_chunked_prefill_mixed_batch_and_batched_decode() -> None:
    """Two sequences: one prefilled in uneven chunks, one fresh in a dirty slot, then both decode together."""
    model = _model()
    cfg = model.config
    a, b = _ids(131, 2), _ids(41, 3)
    full_a, full_b = model(torch.tensor(a)), model(torch.tensor(b))
    cache = HybridCache.allocate(cfg, num_state_slots=2, num_kv_slots=400)
    for t in cache.recurrent + cache.conv:
        t.normal_()  # garbage from an earlier owner: a fresh sequence must not read it
    sa, sb = list(range(0, 131)), list(range(200, 241))
    out_a = [model.forward_batch(ForwardBatch.build([a[:65]], [0], [0], [sa[:65]], all_logits=True), cache)]
    mixed = model.forward_batch(ForwardBatch.build([a[65:130], b[:40]], [65, 0], [0, 1], [sa[:130], sb[:40]],
                                                   all_logits=True), cache)
    out_a.append(mixed[:65])
    assert (torch.cat(out_a) - full_a[:130]).abs().max().item() < TOL
    assert (mixed[65:] - full_b[:40]).abs().max().item() < TOL
    step = model.forward_batch(ForwardBatch.build([[a[130]], [b[40]]], [130, 40], [0, 1], [sa, sb]), cache)
    assert (step[0] - full_a[130]).abs().max().item() < TOL
    assert (step[1] - full_b[40]).abs().max().item() < TOL


def test_greedy_cached_equals_reference_loop() -> None:
    model = _model()
    prompt = _ids(20, 4)
    assert greedy_cached(model, prompt, 10) == greedy_reference(model, prompt, 10)


def test_mtp_layer_cached_equals_no_cache() -> None:
    """The MTP layer reads (token t+1, pre-norm h_t) pairs; prefilled then stepped through its own latent cache
    (the same HybridCache type), it reproduces its no-cache forward."""
    model = _model()
    cfg = model.config
    ids = _ids(61, 5)
    h = model.prenorm_hidden(torch.tensor(ids[:-1]), torch.tensor([0, 60]))
    nxt = torch.tensor(ids[1:])
    full = model.forward_mtp(0, nxt, h)
    assert full.logits.shape == (60, cfg.vocab_size) and full.hidden.shape == (60, cfg.hidden_size)
    cache = allocate_mtp_cache(cfg, num_kv_slots=64)
    assert len(cache.latent) == cfg.num_nextn_predict_layers and not cache.recurrent
    n = 45
    slots = list(range(63, 3, -1))
    pre = model.forward_mtp_batch(0, ForwardBatch.build([ids[1 : n + 1]], [0], [0], [slots[:n]], all_logits=True),
                                  h[:n], cache)
    got_logits, got_hidden = [pre.logits], [pre.hidden]
    for t in range(n, 60):
        step = model.forward_mtp_batch(0, ForwardBatch.build([[ids[t + 1]]], [t], [0], [slots[: t + 1]]),
                                       h[t : t + 1], cache)
        got_logits.append(step.logits)
        got_hidden.append(step.hidden)
    assert (torch.cat(got_logits) - full.logits).abs().max().item() < TOL
    assert (torch.cat(got_hidden) - full.hidden).abs().max().item() < TOL


def test_mtp_input_fusion() -> None:
    """x = eh_proj([enorm(embed(t_next)) zeroed at position 0 ; hnorm(h)]), then the decoder layer and
    lm_head(shared_head.norm(out)), computed by hand from the layer's parts."""
    model = _model()
    mtp = model.model.mtp_layers[0]
    ids = torch.tensor(_ids(12, 6))
    h = torch.randn(12, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    cu = torch.tensor([0, 5, 12])
    assert token_positions(cu).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    with torch.no_grad():
        e = mtp.embed_tokens(ids)
        e[[0, 5]] = 0  # position 0 of each sequence
        x = torch.cat([mtp.enorm(e), mtp.hnorm(h)], dim=-1) @ mtp.eh_proj.weight.T
        x = x + mtp.self_attn(mtp.input_layernorm(x), cu)
        out = x + mtp.block_sparse_moe(mtp.post_attention_layernorm(x))
        logits = model.lm_head(mtp.shared_head.norm(out))
    got = model.forward_mtp(0, ids, h, cu)
    assert (got.hidden - out).abs().max().item() < TOL
    assert (got.logits - logits).abs().max().item() < TOL
