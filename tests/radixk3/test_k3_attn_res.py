"""Block Attention Residuals against the equations, recomputed here from the list of all sublayer outputs
(b_0 = embedding, b_n = sum of block n-1's outputs, plus the current block's partial sum), not incrementally."""

from __future__ import annotations

import math

import pytest
import torch

from radixk3.attn_res import BlockBank
from radixk3.config import preset
from radixk3.model import KimiForCausalLM, build_model

TOL = 1e-5


def _seq_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """Left-to-right sum in the tensors' dtype: every partial sum rounded, as the reference's bf16 bank."""
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def _block(emb: torch.Tensor, outs: list[torch.Tensor], n: int, block: int) -> torch.Tensor:
    """b_n: the embedding for n = 0, else the sum of the sublayer outputs (a, m, a, m, ...) of block n-1."""
    return emb if n == 0 else _seq_sum(outs[2 * (n - 1) * block : 2 * n * block])


def _sources(emb: torch.Tensor, outs: list[torch.Tensor], layer: int, block: int, mlp: bool) -> list[torch.Tensor]:
    """Sources of layer `layer`'s attention (outs holds a_0, m_0, ..., up to m_{layer-1}) or MLP (outs ends with
    a_layer): every block written so far, then the current block's partial sum, which at a block's first layer
    is the block just written (attention) or a_layer alone (MLP)."""
    cur = layer // block
    blocks = [_block(emb, outs, n, block) for n in range(cur + 1)]
    partial = outs[2 * cur * block :]
    if not mlp:
        return blocks if not partial else [*blocks, _seq_sum(partial)]
    return [*blocks, _seq_sum(partial)]


def _mix(sources: list[torch.Tensor], norm: torch.nn.Module, proj: torch.nn.Linear) -> torch.Tensor:
    logits = []
    for s in sources:
        sf = s.double()
        normed = sf / torch.sqrt(sf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
        logits.append(normed @ proj.weight.double()[0])
    alpha = torch.softmax(torch.stack(logits), dim=0)
    return sum(a[:, None] * s.double() for a, s in zip(alpha, sources, strict=True)).float()


def _reference_logits(model: KimiForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    cfg, m = model.config, model.model
    block = cfg.attn_res_block_size
    cu = torch.tensor([0, ids.numel()])
    emb = m.embed_tokens(ids)
    outs: list[torch.Tensor] = []
    for i, layer in enumerate(m.layers):
        x = _mix(_sources(emb, outs, i, block, mlp=False), layer.self_attention_res_norm, layer.self_attention_res_proj)
        outs.append(layer.self_attn(layer.input_layernorm(x), cu))
        x = _mix(_sources(emb, outs, i, block, mlp=True), layer.mlp_res_norm, layer.mlp_res_proj)
        outs.append(layer.feed_forward(layer.post_attention_layernorm(x)))
    n_blocks = math.ceil(cfg.num_hidden_layers / block)
    last = [_block(emb, outs, n, block) for n in range(n_blocks)] + [_seq_sum(outs[2 * (n_blocks - 1) * block :])]
    h = _mix(last, m.output_attn_res_norm, m.output_attn_res_proj)
    return model.lm_head(m.norm(h))


@pytest.mark.parametrize("block", [1, 2, 3, 9])
def test_attn_res_model_matches_the_equations(block: int) -> None:
    """Block sizes 1 (full AttnRes: every layer output is a source), 2, 3 (a partial last block) and 9 (more
    than the 4 layers: one block, sources = embedding + running sum)."""
    model = build_model(preset("k3-tiny-native").replace(attn_res_block_size=block), seed=3)
    ids = torch.randint(0, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(block))
    with torch.no_grad():
        expected = _reference_logits(model, ids)
    got = model(ids)
    assert (got - expected).abs().max().item() < TOL
    additive = build_model(preset("k3-tiny-native").replace(attn_res_block_size=None), seed=3)(ids)
    assert (got - additive).abs().max().item() > 0.1  # the residual really is replaced


@pytest.mark.parametrize("block", [1, 2, 3, 9])
def test_block_bank_sources_and_bf16_rounding(block: int) -> None:
    """The exact source sets, bit for bit, with bf16 sublayer outputs: the partial sum is rounded to bf16 after
    every addition (never accumulated in fp32)."""
    g = torch.Generator().manual_seed(block)
    n_layers, shape = 7, (5, 16)
    emb = torch.randn(shape, generator=g).to(torch.bfloat16)
    bank = BlockBank(emb, block)
    outs: list[torch.Tensor] = []
    mlp_out = None
    for i in range(n_layers):
        got = bank.attention_sources(i, mlp_out)
        expected = _sources(emb, outs, i, block, mlp=False)
        assert len(got) == len(expected) == (i // block + 1 + (i % block != 0))
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        outs.append(torch.randn(shape, generator=g).to(torch.bfloat16))  # a_i
        got = bank.mlp_sources(outs[-1])
        expected = _sources(emb, outs, i, block, mlp=True)
        assert len(got) == len(expected) == i // block + 2
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        mlp_out = torch.randn(shape, generator=g).to(torch.bfloat16)  # m_i
        outs.append(mlp_out)
        bank.check_integrity()
    final = bank.final_sources(mlp_out)
    n_blocks = math.ceil(n_layers / block)
    assert len(final) == n_blocks + 1
    assert torch.equal(final[-1], _seq_sum(outs[2 * (n_blocks - 1) * block :]))
    assert all(b.dtype == torch.bfloat16 for b in final)
    if block > 1:  # rounding after every addition differs from an fp32 sum rounded once
        summed = outs[: 2 * block] if n_blocks > 1 else outs  # b_1, or the one block's partial sum
        fp32_sum = torch.stack([o.float() for o in summed]).sum(0).to(torch.bfloat16)
        assert torch.equal(final[1], _seq_sum(summed)) and not torch.equal(final[1], fp32_sum)


def test_block_bank_refuses_out_of_order_layers() -> None:
    bank = BlockBank(torch.zeros(2, 4), 2)
    bank.attention_sources(0, None)
    with pytest.raises(ValueError, match="in order"):
        bank.attention_sources(2, torch.zeros(2, 4))
