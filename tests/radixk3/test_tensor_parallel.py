"""Tensor parallelism of the whole model: on two spawned gloo ranks, a sharded random model and a sharded load of
a checkpoint give the unsharded logits within 1e-5 (fp32), no-cache and cached (extend, then decode steps, through
the runtime's `PoolBuffer` + `HybridCache` at the `--tp 2` pool layout), for k3-tiny (Kimi-Linear format) and
k3-tiny-native (every K3 feature, MTP included). Without processes: the shard arithmetic, a sharded build is
exactly a shard of the unsharded one (init and load), the padded vocabulary, the pool layout per rank."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.multiprocessing as mp

from radixk3.checkpoint import CheckpointError, load_model, write_checkpoint
from radixk3.config import ConfigError, ModelConfig, preset
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM, build_model
from radixk3.mtp import allocate_mtp_cache
from radixk3.parallel import ParallelState, destroy_parallel, exit_rank, init_parallel, set_parallel_state, shard_range
from radixk3.parallel_linear import ColumnParallelLinear, ParallelLMHead, VocabParallelEmbedding
from radixk3.spec_window import SpecWindow, WindowRows
from radixk3.tensor_names import Shard, public_shards, public_tensors
from runtime.pool_layout import pool_layout
from runtime.server_args import ServerArgs
from runtime.topology import free_port
from runtime.worker.pool_buffer import PoolBuffer
from tests.greedy import greedy_cached

WORLD = 2
SEED = 5
TOL = 1e-5
TIMEOUT_S = 120.0
PRESETS = ("k3-tiny", "k3-tiny-native")
POOL_BYTES = 4 << 20
T = TypeVar("T")


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _as_rank(rank: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run fn under rank `rank` of a tp-2 state without a process group (building and loading need none)."""
    set_parallel_state(ParallelState(tp_rank=rank, tp_size=WORLD))
    try:
        return fn(*args, **kwargs)
    finally:
        set_parallel_state(ParallelState())


# --- what both the ranks and the parent run ---------------------------------------------------------------
def _cache(model: KimiForCausalLM, tp: int) -> tuple[HybridCache, list[int]]:
    """The cache as `runtime.worker.model_worker` builds it: views of one unified pool at this rank's layout; and two
    state slots at the top of the pool, clear of the low KV pages the tests use (states and pages share it)."""
    cfg = model.config
    layout = pool_layout(cfg, ServerArgs(tp_size=tp, mem_bytes=POOL_BYTES))
    assert layout.kda_heads == cfg.kda_num_heads // tp
    buffer = PoolBuffer(layout, POOL_BYTES)
    top = buffer.geometry.num_state_slots - 1
    assert buffer.geometry.state_offset(top - 1) > buffer.geometry.page_offset(200)
    return HybridCache(
        recurrent=[buffer.recurrent_state(i) for i in range(cfg.num_kda_layers)],
        conv=[buffer.conv_state(i) for i in range(cfg.num_kda_layers)],
        latent=[buffer.kv(i) for i in range(cfg.num_mla_layers)],
    ), [top, top - 1]


def _run(model: KimiForCausalLM, tp: int) -> dict[str, torch.Tensor]:
    """No-cache logits of two packed sequences; cached logits: both extended (one in two chunks), three batched
    decode steps, a verify window (ReplaySSM), its commit and a decode step after it; the MTP layer's no-cache
    and cached logits when the model has one."""
    a, b = _ids(37, 1), _ids(23, 2)
    out: dict[str, torch.Tensor] = {}
    out["nocache"] = model(torch.tensor(a + b), torch.tensor([0, len(a), len(a) + len(b)]))
    cache, (sa, sb) = _cache(model, tp)
    slots_a, slots_b = list(range(0, 60)), list(range(100, 160))  # token slots (page size 1)
    steps = [model.forward_batch(ForwardBatch.build([a[:20]], [0], [sa], [slots_a[:20]], all_logits=True), cache)]
    mixed = ForwardBatch.build([a[20:], b], [20, 0], [sa, sb], [slots_a[: len(a)], slots_b[: len(b)]], all_logits=True)
    steps.append(model.forward_batch(mixed, cache))
    seq_a, seq_b = list(a), list(b)
    row_a = len(a) - 20 - 1  # a's last row in the mixed extend; row 0 in every decode step
    for _ in range(3):
        nxt = [int(steps[-1][row_a].argmax()), int(steps[-1][-1].argmax())]
        row_a = 0
        batch = ForwardBatch.build([[nxt[0]], [nxt[1]]], [len(seq_a), len(seq_b)], [sa, sb],
                                   [slots_a[: len(seq_a) + 1], slots_b[: len(seq_b) + 1]])
        seq_a.append(nxt[0])
        seq_b.append(nxt[1])
        steps.append(model.forward_batch(batch, cache))
    out["cached"] = torch.cat(steps)
    # A speculative verify window (ReplaySSM) of 3 drafts each, 2 and 1 of them committed, then a decode step.
    window = SpecWindow.allocate(model.config, "replay", rows=2, width=3, dtype=model.config.torch_dtype)
    drafts = [_ids(3, 3), _ids(3, 4)]
    verify = ForwardBatch.build(drafts, [len(seq_a), len(seq_b)], [sa, sb],
                                [slots_a[: len(seq_a) + 3], slots_b[: len(seq_b) + 3]], all_logits=True)
    verify.mode = ForwardMode.VERIFY
    verify.spec = WindowRows(window, torch.tensor([0, 1]))
    out["verify"] = model.forward_batch(verify, cache)
    window.commit(cache.recurrent, cache.conv, torch.tensor([sa, sb]), torch.tensor([0, 1]), torch.tensor([2, 1]))
    seq_a += drafts[0][:2]
    seq_b += drafts[1][:1]
    step = ForwardBatch.build([[7], [8]], [len(seq_a), len(seq_b)], [sa, sb],
                              [slots_a[: len(seq_a) + 1], slots_b[: len(seq_b) + 1]])
    out["after_commit"] = model.forward_batch(step, cache)
    out["tokens"] = torch.tensor(seq_a + seq_b)
    out["greedy"] = torch.tensor(greedy_cached(model, a[:9], 4))  # over `HybridCache.allocate` at this rank's heads
    if model.config.num_nextn_predict_layers:
        hidden = model.prenorm_hidden(torch.tensor(a), torch.tensor([0, len(a)]))
        mtp = model.forward_mtp(0, torch.tensor(a[1:] + [0]), hidden)
        out["mtp"] = mtp.logits
        mcache = allocate_mtp_cache(model.config, 64)
        batch = ForwardBatch.build([a[1:] + [0]], [0], [0], [list(range(len(a)))], all_logits=True)
        out["mtp_cached"] = model.forward_mtp_batch(0, batch, hidden, mcache).logits
    return out


def _padded_config() -> ModelConfig:
    return dataclasses.replace(preset("k3-tiny"), vocab_size=4095)  # odd: padded to 4096 over two ranks


def _padded_ids() -> torch.Tensor:
    return torch.tensor(_ids(17, 9)) % 4095


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_parallel(rank, WORLD, f"tcp://127.0.0.1:{port}", timeout_s=TIMEOUT_S / 2)
    try:
        for name in PRESETS:  # one spawn for every case: process start-up dominates
            results = {"random": _run(build_model(preset(name), seed=SEED), WORLD),
                       "loaded": _run(load_model(Path(out_dir) / name), WORLD)}
            torch.save(results, Path(out_dir) / f"{name}.rank{rank}.pt")
        padded = build_model(_padded_config(), seed=SEED)
        torch.save(padded(_padded_ids()), Path(out_dir) / f"padded.rank{rank}.pt")
    finally:
        destroy_parallel()
    exit_rank(0)  # a raised error above goes back to the parent through the normal exit


def _run_ranks(out_dir: Path) -> None:
    """Spawn WORLD ranks; fail (and kill them) past TIMEOUT_S."""
    ctx = mp.start_processes(_rank_main, args=(free_port(), str(out_dir)), nprocs=WORLD, join=False,
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


@pytest.fixture(scope="module")
def ranks_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both presets' checkpoints (the unsharded seeded models), then the two ranks' results on them."""
    out = tmp_path_factory.mktemp("tp")
    for name in PRESETS:
        write_checkpoint(build_model(preset(name), seed=SEED), out / name)
    _run_ranks(out)
    return out


@pytest.mark.parametrize("name", PRESETS)
def test_sharded_forward_equals_unsharded(ranks_dir: Path, name: str) -> None:
    full = build_model(preset(name), seed=SEED)
    ref = _run(full, 1)
    assert not ref["nocache"].isnan().any()
    seq_a = ref["tokens"][:42].tolist() + [7]  # the cached path is the model: after the commit too
    assert (full(torch.tensor(seq_a))[-1] - ref["after_commit"][0]).abs().max().item() < TOL
    for r in range(WORLD):
        got = torch.load(ranks_dir / f"{name}.rank{r}.pt")
        for source in ("random", "loaded"):
            assert set(got[source]) == set(ref)
            for key, want in ref.items():
                g = got[source][key]
                assert g.shape == want.shape, (source, key)
                if key in ("tokens", "greedy"):  # greedy tokens identical
                    assert torch.equal(g, want), (name, source, r)
                else:
                    err = (g - want).abs().max().item()
                    assert err < TOL, f"{name} {source} rank {r} {key}: max |diff| {err}"


def test_padded_vocabulary_forward(ranks_dir: Path) -> None:
    want = build_model(_padded_config(), seed=SEED)(_padded_ids())
    assert want.shape == (17, 4095)
    for r in range(WORLD):
        got = torch.load(ranks_dir / f"padded.rank{r}.pt")
        assert got.shape == want.shape and (got - want).abs().max().item() < TOL


# --- without processes -------------------------------------------------------------------------------------
def test_shard_range() -> None:
    assert shard_range(12, 0, 2) == slice(0, 6) and shard_range(12, 1, 2) == slice(6, 12)
    assert shard_range(96, 2, 4, unit=8) == slice(48, 72)
    assert shard_range(5, 0, 1) == slice(0, 5)
    with pytest.raises(ValueError, match="do not split"):
        shard_range(6, 0, 4)
    with pytest.raises(ValueError, match="do not split"):
        shard_range(64, 0, 2, unit=64)  # one head of 64 rows cannot go to two ranks


def test_fused_column_parts_split_separately() -> None:
    lin = _as_rank(1, ColumnParallelLinear, 8, None, parts=[("gate_proj", 6), ("up_proj", 6)])
    assert lin.weight.shape == (6, 8) and lin.sizes == [3, 3]
    assert dict(public_shards(_wrap(lin))) == {
        "gate_proj.weight": Shard((6, 8), (slice(3, 6),)), "up_proj.weight": Shard((6, 8), (slice(3, 6),))}
    assert public_shards(_wrap(ColumnParallelLinear(8, parts=[("gate_proj", 6)]))) == {}  # unsharded: none


def _wrap(module: torch.nn.Module) -> torch.nn.Module:
    parent = torch.nn.Module()
    parent.proj = module
    return parent


@pytest.mark.parametrize("name", PRESETS)
def test_sharded_build_and_load_are_the_shard_of_the_unsharded(tmp_path: Path, name: str) -> None:
    cfg = preset(name)
    full_model = build_model(cfg, seed=SEED)
    full = public_tensors(full_model)
    write_checkpoint(full_model, tmp_path)
    held = {n: torch.zeros(v.shape, dtype=torch.int32) for n, v in full.items()}
    for rank in range(WORLD):
        for model in (_as_rank(rank, build_model, cfg, SEED), _as_rank(rank, load_model, tmp_path)):
            shards, local = public_shards(model), public_tensors(model)
            assert set(local) == set(full)  # no tensor is held by one rank alone outside the MoE's EP
            for n, view in local.items():
                s = shards.get(n)
                assert s is None or s.full_shape == tuple(full[n].shape), n
                want = full[n] if s is None else full[n][s.index]
                assert torch.equal(view, want), (name, rank, n)
        for n, s in public_shards(_as_rank(rank, build_model, cfg)).items():
            held[n][s.index] += 1
    # The sharded tensors are split without overlap or gap; the attention's heads really are split.
    shards = public_shards(_as_rank(0, build_model, cfg))
    for n in shards:
        assert bool((held[n] == 1).all()), n
    assert "model.layers.0.self_attn.q_proj.weight" in shards and "model.layers.1.self_attn.kv_b_proj.weight" in shards
    assert "model.layers.0.self_attn.f_a_proj.weight" not in shards  # low-rank projections are replicated
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" not in shards  # the latent is whole per rank
    assert "model.embed_tokens.weight" in shards and "lm_head.weight" in shards


def test_saving_a_shard_is_refused(tmp_path: Path) -> None:
    model = _as_rank(0, build_model, preset("k3-tiny"), SEED)
    with pytest.raises(CheckpointError, match="tensor-parallel shard"):
        write_checkpoint(model, tmp_path)


def test_padded_vocabulary(tmp_path: Path) -> None:
    """A vocabulary that does not split over tp is padded; the padding is neither public nor in the logits."""
    emb0, emb1 = _as_rank(0, VocabParallelEmbedding, 7, 4), _as_rank(1, VocabParallelEmbedding, 7, 4)
    assert emb0.weight.shape == emb1.weight.shape == (4, 4)
    assert (emb0.num_valid, emb1.num_valid) == (4, 3)
    assert public_shards(_wrap(emb1)) == {"proj.weight": Shard((7, 4), (slice(4, 7),))}
    assert public_tensors(_wrap(emb1))["proj.weight"].shape == (3, 4)
    head = _as_rank(1, ParallelLMHead, 4, 7)
    assert head.weight.shape == (4, 4) and bool((head.weight[3] == 0).all())
    cfg = dataclasses.replace(preset("k3-tiny"), vocab_size=4095)
    full = public_tensors(build_model(cfg, seed=SEED))
    local = public_tensors(_as_rank(1, build_model, cfg, SEED))
    assert torch.equal(local["lm_head.weight"], full["lm_head.weight"][2048:])
    write_checkpoint(build_model(cfg, seed=SEED), tmp_path)
    loaded = _as_rank(1, load_model, tmp_path)
    assert torch.equal(public_tensors(loaded)["model.embed_tokens.weight"], full["model.embed_tokens.weight"][2048:])
    assert bool((loaded.lm_head.weight[-1] == 0).all())  # the padding row


def test_pool_layout_is_this_ranks_share() -> None:
    cfg: ModelConfig = preset("k3-tiny-native")
    one = pool_layout(cfg, ServerArgs(mem_bytes=POOL_BYTES))
    two = pool_layout(cfg, ServerArgs(tp_size=2, mem_bytes=POOL_BYTES, speculative_algorithm="mtp"))
    assert two.kda_heads * 2 == one.kda_heads == cfg.kda_num_heads
    assert two.conv_shape[0] * 2 == one.conv_shape[0] and two.kv_dim == one.kv_dim  # the latent is not sharded
    assert two.draft is not None and two.draft.num_mla_layers == cfg.num_nextn_predict_layers
    model = _as_rank(1, build_model, cfg)
    kda = model.model.layers[0].self_attn
    assert two.recurrent_shape == (kda.num_heads, kda.head_dim, kda.head_dim)
    assert two.conv_shape == (kda.conv_weight().shape[0], cfg.conv_kernel_size - 1)
    with pytest.raises(ValueError, match="does not split"):
        pool_layout(cfg, ServerArgs(tp_size=4, mem_bytes=POOL_BYTES))


def test_a_split_that_does_not_fit_is_refused_clearly() -> None:
    cfg = preset("k3-tiny")  # 2 KDA heads, 2 MLA heads
    set_parallel_state(ParallelState(tp_rank=0, tp_size=4))
    try:
        with pytest.raises(ConfigError, match="--tp 4 must divide kda_num_heads"):
            build_model(cfg)
        with pytest.raises(ConfigError, match="--tp 4 must divide num_attention_heads"):
            build_model(dataclasses.replace(cfg, kda_num_heads=4))
    finally:
        set_parallel_state(ParallelState())
