"""MoE tensor and expert parallelism: the sharded MoE block on spawned gloo ranks (tp 2, tp 2 + ep 2) equals the
unsharded block within 1e-5 (fp32), for the Kimi-Linear MoE (SwiGLU, shared expert) and K3's LatentMoE with and
without its routed-expert norm; the whole k3-tiny models tp 2 + ep 2 against the unsharded logits; tp 4 + ep 2
routed partial sums, the shard arithmetic and the local dispatch without processes."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kernels.moe import moe_experts
from kernels.moe_route import MoERoute
from radixk3.config import ConfigError, ModelConfig, preset
from radixk3.moe_layer import MoE, dispatch_local, moe_shard
from radixk3.parallel import (
    ParallelState,
    destroy_parallel,
    exit_rank,
    init_parallel,
    parallel_state,
    set_parallel_state,
)
from radixk3.tensor_names import Shard, public_shards, public_tensors
from runtime.topology import free_port

WORLD = 2
TIMEOUT_S = 90.0


def _configs() -> dict[str, ModelConfig]:
    native = preset("k3-tiny-native")
    return {
        "kimi-linear": preset("k3-tiny"),  # SwiGLU experts in the hidden dim, grouped routing, a shared expert
        "latent-norm": native,  # LatentMoE, RMSNorm of the routed sum, SiTU-GLU
        "latent": dataclasses.replace(native, latent_moe_use_norm=False),
    }


def _full_moe(cfg: ModelConfig, seed: int) -> MoE:
    """The unsharded block with seeded weights (each public tensor drawn in name order; the correction bias
    too, so that it changes the choices)."""
    saved = parallel_state()
    set_parallel_state(ParallelState())
    try:
        moe = MoE(cfg)
    finally:
        set_parallel_state(saved)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, view in sorted(public_tensors(moe).items()):
            if "norm" in name:
                view.copy_(1 + 0.1 * torch.randn(view.shape, generator=gen))
            elif "bias" in name:
                view.copy_(0.1 * torch.randn(view.shape, generator=gen))
            else:
                view.copy_(torch.randn(view.shape, generator=gen) / math.sqrt(view.shape[-1]))
    return moe.eval()


def _load_shard(shard: MoE, full: MoE) -> None:
    """What the loader does: every public tensor this rank holds gets full[index] (or the whole tensor)."""
    whole = public_tensors(full)
    local = public_tensors(shard)
    shards = public_shards(shard)
    assert set(local) <= set(whole)
    # Names this rank does not hold are exactly the declared remote ones.
    assert {n for n, s in shards.items() if s.index is None} == set(whole) - set(local)
    with torch.no_grad():
        for name, view in local.items():
            src = whole[name]
            s = shards.get(name)
            if s is not None:
                assert s.index is not None and s.full_shape == tuple(src.shape)
                src = src[s.index]
            view.copy_(src)


def _inputs(cfg: ModelConfig) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(13, cfg.hidden_size, generator=gen)
    return [x, x[:1], x[:0]]  # a prefill, a one-token decode (the kernel's one-token path), no tokens


def _block_cases(rank: int, base: ParallelState) -> dict[str, list[torch.Tensor]]:
    results: dict[str, list[torch.Tensor]] = {}
    for ep in (1, 2):
        state = ParallelState(base.tp_rank, base.tp_size, rank // (WORLD // ep), ep, base.group)
        for name, cfg in _configs().items():
            full = _full_moe(cfg, seed=3)
            set_parallel_state(state)
            shard = MoE(cfg).eval()
            _load_shard(shard, full)
            assert sum(p.numel() for p in shard.experts.parameters()) * WORLD == sum(
                p.numel() for p in full.experts.parameters())
            with torch.no_grad():
                results[f"{name}/ep{ep}"] = [shard(x) for x in _inputs(cfg)]
                # The experts really are split: this rank's routed part alone is far from the whole.
                x0 = _inputs(cfg)[0]
                w, ids = shard.gate(x0)
                u = x0 if shard.routed_expert_down_proj is None else shard.routed_expert_down_proj(x0)
                part, whole = shard.experts(u, w, ids), full.experts(u, w, ids)
                assert (part - whole).abs().max() > 1e-2
    return results


def run_ranks(fn: object, out_dir: Path, *args: object) -> None:
    """Spawn WORLD ranks running fn(rank, port, out_dir, *args); fail (and kill them) past TIMEOUT_S."""
    ctx = mp.start_processes(fn, args=(free_port(), str(out_dir), *args), nprocs=WORLD, join=False,
                             start_method="spawn")
    try:
        t0 = time.monotonic()
        while not ctx.join(timeout=1.0):
            if time.monotonic() - t0 > TIMEOUT_S:
                raise TimeoutError(f"ranks did not finish within {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)


def test_sharded_moe_equals_unsharded(rank_results: list[dict]) -> None:
    ranks = [r["blocks"] for r in rank_results]
    cases = 0
    for name, cfg in _configs().items():
        full = _full_moe(cfg, seed=3)
        with torch.no_grad():
            refs = [full(x) for x in _inputs(cfg)]
        for ep in (1, 2):
            for r in range(WORLD):
                got = ranks[r][f"{name}/ep{ep}"]
                for g, ref in zip(got, refs, strict=True):
                    assert g.shape == ref.shape
                    torch.testing.assert_close(g, ref, rtol=0, atol=1e-5, msg=f"{name} ep{ep} rank {r}")
                cases += 1
    assert cases == 3 * 2 * WORLD


def test_shard_arithmetic() -> None:
    cfg = preset("k3-tiny")  # 8 experts, intermediate 32, one shared expert
    s = moe_shard(cfg, ParallelState(tp_rank=3, tp_size=4, ep_rank=1, ep_size=2))
    assert s.experts == range(4, 8) and s.inter == slice(16, 32)
    s = moe_shard(cfg, ParallelState(tp_rank=1, tp_size=2))
    assert s.experts == range(8) and s.inter == slice(16, 32)
    assert moe_shard(cfg, ParallelState()) == (range(8), slice(0, 32))
    with pytest.raises(ConfigError, match="--ep 3"):
        moe_shard(dataclasses.replace(cfg, num_experts=8), ParallelState(tp_rank=0, tp_size=3, ep_size=3))


def test_declared_shards_of_an_ep_rank() -> None:
    cfg = preset("k3-tiny")
    set_parallel_state(ParallelState(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2))
    try:
        moe = MoE(cfg)
    finally:
        set_parallel_state(ParallelState())
    shards = public_shards(moe)
    i, d = cfg.moe_intermediate_size, cfg.hidden_size
    assert shards["experts.0.w1.weight"] == Shard((i, d), None)
    assert shards["experts.5.w2.weight"] == Shard((d, i), (slice(None), slice(0, i)))
    assert shards["experts.5.w1.weight"] == Shard((i, d), (slice(0, i),))
    assert shards["shared_experts.down_proj.weight"] == Shard((d, i), (slice(None), slice(16, 32)))
    assert shards["shared_experts.up_proj.weight"] == Shard((i, d), (slice(16, 32),))
    assert "gate.weight" not in shards  # the router is replicated
    assert moe.experts.w13_weight.shape == (4, 2 * i, d)
    assert public_shards(MoE(cfg)) == {}  # unsharded: nothing declared


def test_dispatch_local_selects_this_ranks_pairs() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(10)])
    weights = torch.rand(10, 3, generator=gen)
    pairs = dispatch_local(MoERoute(weights, ids), range(4, 8))
    expect = [(t, int(ids[t, c]) - 4, float(weights[t, c])) for t in range(10) for c in range(3) if ids[t, c] >= 4]
    got = list(zip(pairs.tokens.tolist(), pairs.route.experts[:, 0].tolist(), pairs.route.weights[:, 0].tolist(),
                   strict=True))
    assert got == expect
    # The two halves' dispatched outputs add up to the whole experts' output.
    x = torch.randn(10, 6, generator=gen)
    w13, w2 = torch.randn(8, 10, 6, generator=gen), torch.randn(8, 6, 5, generator=gen)
    whole = moe_experts(x, MoERoute(weights, ids), w13, w2)
    total = torch.zeros_like(x)
    for held in (range(0, 4), range(4, 8)):
        p = dispatch_local(MoERoute(weights, ids), held)
        y = moe_experts(x[p.tokens], p.route, w13[held.start:held.stop], w2[held.start:held.stop])
        total.index_add_(0, p.tokens, y)
    torch.testing.assert_close(total, whole, rtol=0, atol=1e-5)


MODEL_PRESETS = ("k3-tiny", "k3-tiny-native")


def _model_ids() -> torch.Tensor:
    return torch.randint(0, 4096, (2, 11), generator=torch.Generator().manual_seed(5))


def _model_cases(rank: int, base: ParallelState, out_dir: str) -> dict[str, torch.Tensor]:
    from radixk3.checkpoint import load_model
    from radixk3.model import build_model

    set_parallel_state(ParallelState(base.tp_rank, base.tp_size, rank, 2, base.group))  # tp 2, ep 2
    with torch.no_grad():
        logits = {name: build_model(preset(name), seed=0)(_model_ids()) for name in MODEL_PRESETS}
        # Loaded: each rank reads its experts' slices and skips the other rank's experts.
        loaded = load_model(Path(out_dir) / "ckpt")
        assert loaded.model.layers[1].block_sparse_moe.experts.w13_weight.shape[0] == 4
        logits["loaded"] = loaded(_model_ids())
    return logits


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    """One spawn for every case (process start-up dominates): the MoE blocks, then the whole models."""
    torch.set_num_threads(1)
    base = init_parallel(rank, WORLD, f"tcp://127.0.0.1:{port}", timeout_s=TIMEOUT_S / 2)
    try:
        out = {"blocks": _block_cases(rank, base), "model": _model_cases(rank, base, out_dir)}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_parallel()
    exit_rank(0)  # a raised error above goes back to the parent through the normal exit


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from radixk3.checkpoint import write_random_checkpoint

    out_dir = tmp_path_factory.mktemp("moe_parallel")
    write_random_checkpoint(preset("k3-tiny-native"), out_dir / "ckpt", seed=2)
    run_ranks(_rank_main, out_dir)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def test_whole_model_tp2_ep2_logits(rank_results: list[dict]) -> None:
    """k3-tiny (Kimi-Linear MoE) and k3-tiny-native (LatentMoE with norm) built sharded (tp 2, ep 2: each rank
    holds half the experts, whole) give the unsharded no-cache logits within 1e-5; so does a tp2 ep2 load of a
    k3-tiny-native checkpoint."""
    from radixk3.model import build_model

    ranks = [r["model"] for r in rank_results]
    for name, cfg, seed in [*((n, preset(n), 0) for n in MODEL_PRESETS), ("loaded", preset("k3-tiny-native"), 2)]:
        assert cfg.torch_dtype == torch.float32
        with torch.no_grad():
            ref = build_model(cfg, seed=seed)(_model_ids())
        for r in range(WORLD):
            torch.testing.assert_close(ranks[r][name], ref, rtol=0, atol=1e-5, msg=f"{name} rank {r}")


@pytest.mark.parametrize("name", ["kimi-linear", "latent-norm"])
def test_tp4_ep2_routed_partials_add_up(name: str) -> None:
    """tp 4, ep 2 (both splits at once: 4 experts per EP rank, each expert's intermediate halved): the four
    ranks' routed partial sums (what the all-reduce adds) equal the whole routed experts' output."""
    cfg = _configs()[name]
    full = _full_moe(cfg, seed=3)
    x = _inputs(cfg)[0]
    u = x if full.routed_expert_down_proj is None else full.routed_expert_down_proj(x)
    with torch.no_grad():
        w, ids = full.gate(x)
        total = torch.zeros_like(u)
        held = []
        for rank in range(4):
            set_parallel_state(ParallelState(tp_rank=rank, tp_size=4, ep_rank=rank // 2, ep_size=2))
            try:
                shard = MoE(cfg)
            finally:
                set_parallel_state(ParallelState())
            _load_shard(shard, full)
            held.append((shard.experts.held, shard.experts.inter))
            total += shard.experts(u, w, ids)
        torch.testing.assert_close(total, full.experts(u, w, ids), rtol=0, atol=1e-5)
    assert held == [(range(0, 4), slice(0, 16)), (range(0, 4), slice(16, 32)),
                    (range(4, 8), slice(0, 16)), (range(4, 8), slice(16, 32))]
