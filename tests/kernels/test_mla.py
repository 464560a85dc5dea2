"""MLA over a latent cache: expanded == absorbed == dense attention built independently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.mla import mla_attention

H, DN, DR, DV, R = 3, 8, 4, 6, 10


def dense(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, w: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence whose queries are the last tokens: full per-head K/V, then SDPA with a bottom-right mask."""
    c, k_pe = latent[:, :R], latent[:, R:]
    kv = (c @ w.t()).view(-1, H, DN + DV)
    k = torch.cat([kv[..., :DN], k_pe[:, None].expand(-1, H, -1)], -1)
    v = kv[..., DN:]
    q = torch.cat([q_nope, q_pe], -1)
    nq, nk = q.shape[0], k.shape[0]
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize(
    "q_lens,kv_lens",
    [([5, 1, 7], [5, 9, 7]), ([1, 1, 1], [1, 30, 12]), ([4], [4]),
     # lengths far apart: several padded groups, in an order unlike the input's
     ([1, 3, 1, 150, 2, 1], [200, 3, 1, 150, 7, 90]),
     # a few new tokens after a long cached prefix (the absorbed form), many after a short one (expanded)
     ([4, 66], [300, 90])],
)
def test_expanded_absorbed_dense_agree(q_lens: list[int], kv_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(sum(kv_lens))
    t, lkv = sum(q_lens), sum(kv_lens)
    q_nope = torch.randn(t, H, DN, generator=gen)
    q_pe = torch.randn(t, H, DR, generator=gen)
    latent = torch.randn(lkv, R + DR, generator=gen)
    w = torch.randn(H * (DN + DV), R, generator=gen) / R**0.5
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    cu_kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()])
    scale = (DN + DR) ** -0.5
    kw = dict(cu_q=cu_q, cu_kv=cu_kv, scale=scale)
    exp = mla_attention(q_nope, q_pe, latent, w, absorbed=False, **kw)
    absd = mla_attention(q_nope, q_pe, latent, w, absorbed=True, **kw)
    torch.testing.assert_close(exp, absd, rtol=0, atol=1e-5)
    ref = torch.cat(
        [
            dense(q_nope[cu_q[i] : cu_q[i + 1]], q_pe[cu_q[i] : cu_q[i + 1]], latent[cu_kv[i] : cu_kv[i + 1]], w, scale)
            for i in range(len(q_lens))
        ]
    )
    torch.testing.assert_close(exp, ref, rtol=0, atol=1e-5)
    assert exp.shape == (t, H, DV)


def test_length_groups_cover_every_sequence_and_bound_padding() -> None:
    from kernels.mla import _PAD_SLACK, _PAD_WASTE, length_groups

    q_lens = [1, 3, 1, 150, 2, 1, 0, 64]
    kv_lens = [200, 3, 1, 150, 7, 90, 5, 4000]
    groups = length_groups(q_lens, kv_lens)
    assert sorted(i for g in groups for i in g) == [i for i, q in enumerate(q_lens) if q > 0]
    assert len(groups) > 1
    for g in groups:
        padded = len(g) * max(q_lens[i] for i in g) * max(kv_lens[i] for i in g)
        assert len(g) == 1 or padded <= _PAD_WASTE * sum(q_lens[i] * kv_lens[i] for i in g) + _PAD_SLACK


# The prefill form's expansion of K/V over a group's latent rows (the einsum no absorbed group runs).
EXPAND = "gsr,hdr->gshd"


def _einsum_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The equations of every torch.einsum call from now on."""
    seen: list[str] = []
    einsum = torch.einsum

    def spy(eq: str, *ops: torch.Tensor) -> torch.Tensor:
        seen.append(eq)
        return einsum(eq, *ops)

    monkeypatch.setattr(torch, "einsum", spy)
    return seen


def test_single_queries_take_the_absorbed_form_in_an_expanded_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows riding in a prefill step are computed as in a decode step: no K/V is expanded over their
    contexts (the expansion is the prefill form's einsum over a group's latent rows)."""
    seen = _einsum_calls(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    q_lens, kv_lens = [40, 1, 1], [300, 250, 20]  # a prefill chunk and two decode rows, in separate groups
    t, lkv = sum(q_lens), sum(kv_lens)
    q_nope, q_pe = torch.randn(t, H, DN, generator=gen), torch.randn(t, H, DR, generator=gen)
    latent = torch.randn(lkv, R + DR, generator=gen)
    w = torch.randn(H * (DN + DV), R, generator=gen) / R**0.5
    kw = dict(cu_q=torch.tensor([0, 40, 41, 42]), cu_kv=torch.tensor([0, 300, 550, 570]), scale=0.3)
    exp = mla_attention(q_nope, q_pe, latent, w, absorbed=False, **kw)
    assert seen.count(EXPAND) == 1  # the chunk's group only
    absd = mla_attention(q_nope, q_pe, latent, w, absorbed=True, **kw)
    torch.testing.assert_close(exp, absd, rtol=0, atol=1e-5)


def test_few_queries_over_a_long_prefix_take_the_absorbed_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's own tokens after a long cached prefix (a burst's followers): the absorbed form multiplies less
    than decompressing K and V over the whole prefix, so no K/V is expanded for them; a whole prompt still is."""
    seen = _einsum_calls(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    for q_len, kv_len, expanded in ((4, 600, 0), (200, 200, 1)):
        seen.clear()
        q_nope, q_pe = torch.randn(q_len, H, DN, generator=gen), torch.randn(q_len, H, DR, generator=gen)
        latent = torch.randn(kv_len, R + DR, generator=gen)
        w = torch.randn(H * (DN + DV), R, generator=gen) / R**0.5
        kw = dict(cu_q=torch.tensor([0, q_len]), cu_kv=torch.tensor([0, kv_len]), scale=0.3)
        got = mla_attention(q_nope, q_pe, latent, w, absorbed=False, **kw)
        assert seen.count(EXPAND) == expanded
        torch.testing.assert_close(got, dense(q_nope, q_pe, latent, w, 0.3), rtol=0, atol=1e-5)
