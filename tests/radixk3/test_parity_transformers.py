"""Parity with the external oracle: transformers' KimiLinearForCausalLM on a checkpoint radixk3 wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oracles import transformers_module
from radixk3.checkpoint import load_model

TOL = 1e-4  # fp32 logits, max abs (the bar)


@pytest.fixture(scope="module")
def pair(tiny_checkpoint: Path):  # noqa: ANN201
    tf = transformers_module()
    ref = tf.KimiLinearForCausalLM.from_pretrained(
        tiny_checkpoint, use_kernels=False, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    return load_model(tiny_checkpoint), ref


def test_full_forward_logits_match(pair) -> None:  # noqa: ANN001
    ours, ref = pair
    ids = torch.randint(0, ours.config.vocab_size, (2, 130), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(input_ids=ids, use_cache=False).logits
    got = ours(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOL


def _hf_layer(ref, i: int):  # noqa: ANN001, ANN202
    return ref.model.layers[i]


def test_kda_layer_matches(pair) -> None:  # noqa: ANN001
    ours, ref = pair
    i = ours.config.kda_layers[1]
    x = torch.randn(1, 90, ours.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = _hf_layer(ref, i).self_attn(hidden_states=x)
        got = ours.model.layers[i].self_attn(x[0], torch.tensor([0, 90]))
    assert (got - expected[0]).abs().max().item() < 1e-5


def test_mla_layer_matches(pair) -> None:  # noqa: ANN001
    ours, ref = pair
    i = ours.config.mla_layers[0]
    t = 70
    x = torch.randn(1, t, ours.config.hidden_size, generator=torch.Generator().manual_seed(5))
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = _hf_layer(ref, i).self_attn(hidden_states=x, attention_mask=mask)
        got = ours.model.layers[i].self_attn(x[0], torch.tensor([0, t]))
    assert (got - expected[0]).abs().max().item() < 1e-5


def test_moe_matches(pair) -> None:  # noqa: ANN001
    ours, ref = pair
    i = ours.config.first_k_dense_replace
    x = torch.randn(50, ours.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = _hf_layer(ref, i).mlp(x[None])[0]
        got = ours.model.layers[i].block_sparse_moe(x)
    assert (got - expected).abs().max().item() < 1e-5
