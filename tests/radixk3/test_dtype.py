"""Serving dtype: the same weights in fp32 and cast to bf16 (`cast_`), no-cache forwards compared.

Tolerances come from bf16's unit roundoff U = 2^-8 (8 significand bits, round to nearest). A GEMM whose inputs
and weights are rounded carries a relative error of about sqrt(2/3) U (RMS, independent roundings), its rounded
output another U / sqrt(3); a sublayer chains two to four such stages, so about 2 U; each sublayer must stay
within 4 U. Over the model, 2L sublayers plus the embedding and the head add in quadrature: the typical token's
logits stay within sqrt(2L + 2) * 4 U. Only the typical (median) token is bounded: the router's top-k is
discrete, and where bf16 rounding flips an expert choice that token's output (and, through attention, later
tokens' outputs) changes by O(1), which no precision argument bounds. Run with `-s` to see the agreement rates.
"""

from __future__ import annotations

import copy

import pytest
import torch

from radixk3.config import preset
from radixk3.model import KimiForCausalLM, build_model
from tests.greedy import greedy_reference

U = 2.0**-8
SUBLAYER_TOL = 4 * U
PRESETS = ["k3-tiny", "k3-tiny-native"]


def _pair(name: str) -> tuple[KimiForCausalLM, KimiForCausalLM]:
    fp32 = build_model(preset(name), seed=3)
    return fp32, copy.deepcopy(fp32).cast_(torch.bfloat16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of b against a along the last dim."""
    return (a - b.float()).norm(dim=-1) / a.norm(dim=-1)


@pytest.mark.parametrize("name", PRESETS)
def test_every_sublayer_within_bf16_rounding(name: str) -> None:
    """Each sublayer on the same input values (bf16-representable, so the fp32 router sees exactly what the bf16
    one sees and both route alike): only weight and internal roundings differ."""
    fp32, bf16 = _pair(name)
    x = torch.randn(96, fp32.config.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    cu = torch.tensor([0, 40, 96])
    checked = set()
    with torch.no_grad():
        for layer32, layer16 in zip(fp32.model.layers, bf16.model.layers, strict=True):
            for sub in ("self_attn", "mlp", "block_sparse_moe"):
                if not hasattr(layer32, sub):
                    continue
                f32, f16 = getattr(layer32, sub), getattr(layer16, sub)
                args = (cu,) if sub == "self_attn" else ()
                got = f16(x, *args)
                assert got.dtype == torch.bfloat16
                err = _rel(f32(x.float(), *args).flatten(), got.flatten()).item()
                assert err < SUBLAYER_TOL, (type(f32).__name__, err / U)
                checked.add(type(f32).__name__)
    assert checked == {"KDAAttention", "MLAAttention", "MLP", "MoE"}


@pytest.mark.parametrize("name", PRESETS)
def test_logits_and_greedy_agreement(name: str) -> None:
    fp32, bf16 = _pair(name)
    cfg = fp32.config
    ids = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    ref, got = fp32(ids), bf16(ids)
    assert got.dtype == torch.bfloat16
    per_token = _rel(ref, got).flatten()
    tol = (2 * cfg.num_hidden_layers + 2) ** 0.5 * SUBLAYER_TOL
    assert per_token.median().item() < tol, per_token.median().item() / U
    # Teacher-forced top-1 agreement, and greedy continuations of 12 tokens (common prefix share).
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    prefix = []
    for row in ids[:, :16].tolist():
        a, b = greedy_reference(fp32, row, 12), greedy_reference(bf16, row, 12)
        prefix.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) / len(a))
    print(f"\n{name}: bf16 vs fp32 median token logit error {per_token.median().item() / U:.1f} U "
          f"(bound {tol / U:.1f} U), tokens past the bound {(per_token > tol).float().mean().item():.1%}, "
          f"teacher-forced top-1 agreement {top1:.1%}, greedy common prefix {sum(prefix) / len(prefix):.1%}")
    # Floor with a reason: at least half the positions are within the bound (the median check above), and
    # within it the argmax moves only at near-ties of the top two logits, which are a minority at random weights.
    assert top1 >= 0.5
