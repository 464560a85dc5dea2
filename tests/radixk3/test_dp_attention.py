"""DP attention of the whole model (`init_parallel(..., dp_size=2)` on two spawned gloo ranks, tp 2 dp 2, attn_tp
1): each rank runs DIFFERENT sequences through attention replicated in its own group, the MoE / MLP sharded over
both ranks on both groups' gathered tokens; each rank's logits equal the unsharded model's on its own sequences
within 1e-5 (fp32), no-cache and cached (extend, decode, through the runtime's `PoolBuffer` + `HybridCache` at
the DP-attention pool layout), a verify window per rank (ReplaySSM: each replays its own requests) with its
commit, one rank idle (zero rows, an IDLE batch) in some steps; for k3-tiny and k3-tiny-native (LatentMoE,
Attention Residuals, MTP), random and loaded from the unsharded checkpoint. Without processes: the group
arithmetic, the head split check and the pool layout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from radixk3.checkpoint import load_model, write_checkpoint
from radixk3.config import ConfigError, ModelConfig, preset
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM, build_model, check_tensor_parallel
from radixk3.mtp import allocate_mtp_cache
from radixk3.parallel import ParallelState, destroy_parallel, exit_rank, init_parallel, parallel_state
from radixk3.spec_window import SpecWindow, WindowRows
from runtime.pool_layout import pool_layout
from runtime.server_args import ServerArgs
from runtime.topology import free_port
from runtime.worker.pool_buffer import PoolBuffer

WORLD = 2
DP = 2
SEED = 7
TOL = 1e-5
TIMEOUT_S = 150.0
PRESETS = ("k3-tiny", "k3-tiny-native")
POOL_BYTES = 4 << 20


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _idle_batch() -> ForwardBatch:
    z = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch.from_table(ForwardMode.IDLE, z, torch.zeros(1, dtype=torch.int64), z, z,
                                   torch.zeros(0, 0, dtype=torch.int64), 1)


def _cache(model: KimiForCausalLM, args: ServerArgs) -> tuple[HybridCache, list[int]]:
    """Views of one unified pool at this rank's layout, as `runtime.worker.model_worker` builds them; two state slots
    at the top."""
    cfg = model.config
    layout = pool_layout(cfg, args)
    buffer = PoolBuffer(layout, POOL_BYTES)
    top = buffer.geometry.num_state_slots - 1
    assert buffer.geometry.state_offset(top - 1) > buffer.geometry.page_offset(200)  # clear of the KV used
    return HybridCache(
        recurrent=[buffer.recurrent_state(i) for i in range(cfg.num_kda_layers)],
        conv=[buffer.conv_state(i) for i in range(cfg.num_kda_layers)],
        latent=[buffer.kv(i) for i in range(cfg.num_mla_layers)],
    ), [top, top - 1]


def _program(model: KimiForCausalLM, rank: int, args: ServerArgs) -> dict[str, torch.Tensor]:
    """Rank `rank`'s own requests, in the step order every rank follows (lockstep: the same number of forwards
    on every rank, a rank with nothing to run giving zero rows / an IDLE batch). Run single-rank on the
    unsharded model this is the oracle (idle steps do nothing there)."""
    if rank == 0:
        seqs = [_ids(29, 1), _ids(17, 2)]
    else:
        seqs = [_ids(21, 3)]
    out: dict[str, torch.Tensor] = {}
    lens = [len(s) for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    out["nocache"] = model(torch.tensor([x for s in seqs for x in s]), cu)
    # No-cache with rank 1 idle: zero rows through the forward.
    solo = seqs[0][:11] if rank == 0 else []
    out["nocache_idle"] = model(torch.tensor(solo, dtype=torch.int64), torch.tensor([0, len(solo)]))
    cache, slots = _cache(model, args)
    kv = [list(range(i * 100, i * 100 + 60)) for i in range(len(seqs))]
    steps: list[torch.Tensor] = []
    if rank == 0:  # step 1: the first chunk of seqs[0]; rank 1 idle
        steps.append(model.forward_batch(ForwardBatch.build([seqs[0][:10]], [0], slots[:1], [kv[0][:10]],
                                                            all_logits=True), cache))
        first = [seqs[0][10:], seqs[1]]
        prefix = [10, 0]
    else:
        model.forward_batch(_idle_batch(), cache)
        first, prefix = [seqs[0]], [0]
    n = len(seqs)
    steps.append(model.forward_batch(ForwardBatch.build(first, prefix, slots[:n],
                                                        [kv[i][: lens[i]] for i in range(n)], all_logits=True),
                                     cache))
    seq = [list(s) for s in seqs]
    for step in range(3):
        if rank == 1 and step == 1:  # rank 1 idle in the middle of the decodes
            model.forward_batch(_idle_batch(), cache)
            continue
        last = steps[-1][torch.tensor([len(f) for f in first]).cumsum(0) - 1] if step == 0 else steps[-1]
        nxt = last.argmax(-1).tolist()
        batch = ForwardBatch.build([[t] for t in nxt], [len(s) for s in seq], slots[:n],
                                   [kv[i][: len(seq[i]) + 1] for i in range(n)])
        for s, t in zip(seq, nxt, strict=True):
            s.append(t)
        steps.append(model.forward_batch(batch, cache))
    out["cached"] = torch.cat(steps)
    # Speculative verify per DP rank (ReplaySSM: each rank replays its own requests): 3 drafts per sequence,
    # some committed, then a decode step after the commit.
    window = SpecWindow.allocate(model.config, "replay", rows=n, width=3, dtype=model.config.torch_dtype)
    drafts = [_ids(3, 10 + rank * 2 + i) for i in range(n)]
    verify = ForwardBatch.build(drafts, [len(s) for s in seq], slots[:n],
                                [kv[i][: len(seq[i]) + 3] for i in range(n)], all_logits=True)
    verify.mode = ForwardMode.VERIFY
    rows = torch.arange(n)
    verify.spec = WindowRows(window, rows)
    out["verify"] = model.forward_batch(verify, cache)
    keep = [2, 1][:n] if rank == 0 else [3]
    window.commit(cache.recurrent, cache.conv, torch.tensor(slots[:n]), rows, torch.tensor(keep))
    for s, d, k in zip(seq, drafts, keep, strict=True):
        s += d[:k]
    step_batch = ForwardBatch.build([[7 + i] for i in range(n)], [len(s) for s in seq], slots[:n],
                                    [kv[i][: len(seq[i]) + 1] for i in range(n)])
    out["after_commit"] = model.forward_batch(step_batch, cache)
    out["tokens"] = torch.tensor([x for s in seq for x in s])
    if model.config.num_nextn_predict_layers:
        a = seqs[0]
        hidden = model.prenorm_hidden(torch.tensor(a), torch.tensor([0, len(a)]))
        out["mtp"] = model.forward_mtp(0, torch.tensor(a[1:] + [0]), hidden).logits
        mcache = allocate_mtp_cache(model.config, 64)
        if rank == 0:
            batch = ForwardBatch.build([a[1:] + [0]], [0], [0], [list(range(len(a)))], all_logits=True)
            out["mtp_cached"] = model.forward_mtp_batch(0, batch, hidden, mcache).logits
        else:  # rank 1 idle in the cached MTP step
            out["mtp_cached"] = model.forward_mtp_batch(0, _idle_batch(), hidden[:0], mcache).logits
    return out


def _args() -> ServerArgs:
    return ServerArgs(tp_size=WORLD, dp_size=DP, enable_dp_attention=True, mem_bytes=POOL_BYTES)


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    state = init_parallel(rank, WORLD, f"tcp://127.0.0.1:{port}", timeout_s=TIMEOUT_S / 2, dp_size=DP)
    try:
        assert (state.dp_rank, state.attn_tp_size, state.attn_tp_rank) == (rank, 1, 0)
        for name in PRESETS:  # random weights, and a load of the unsharded checkpoint (each rank its parts)
            results = {"random": _program(build_model(preset(name), seed=SEED), rank, _args()),
                       "loaded": _program(load_model(Path(out_dir) / name), rank, _args())}
            torch.save(results, Path(out_dir) / f"{name}.rank{rank}.pt")
    finally:
        destroy_parallel()
    exit_rank(0)  # a raised error above goes back to the parent through the normal exit


@pytest.fixture(scope="module")
def ranks_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both presets' checkpoints, then the two ranks spawned once for both; fail (and kill them) past TIMEOUT_S."""
    out = tmp_path_factory.mktemp("dp_attn")
    for name in PRESETS:
        write_checkpoint(build_model(preset(name), seed=SEED), out / name)
    ctx = mp.start_processes(_rank_main, args=(free_port(), str(out)), nprocs=WORLD, join=False,
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
    return out


@pytest.mark.parametrize("name", PRESETS)
def test_dp_attention_forward_equals_unsharded(ranks_dir: Path, name: str) -> None:
    full = build_model(preset(name), seed=SEED)
    single = ServerArgs(mem_bytes=POOL_BYTES)
    refs = [_program(full, r, single) for r in range(WORLD)]
    assert not torch.equal(refs[0]["nocache"][:5], refs[1]["nocache"][:5])  # the ranks' requests differ
    assert refs[1]["nocache_idle"].shape == (0, full.config.vocab_size)
    for r in range(WORLD):
        for source, got in torch.load(ranks_dir / f"{name}.rank{r}.pt").items():
            assert set(got) == set(refs[r])
            for key, want in refs[r].items():
                g = got[key]
                assert g.shape == want.shape, (name, source, r, key)
                if key == "tokens":
                    assert torch.equal(g, want), (name, source, r)
                elif want.numel():
                    err = (g - want).abs().max().item()
                    assert err < TOL, f"{name} {source} rank {r} {key}: max |diff| {err}"


def test_group_arithmetic() -> None:
    s = ParallelState(tp_rank=5, tp_size=8, dp_size=4)
    assert (s.attn_tp_size, s.attn_tp_rank, s.dp_rank, s.dp_attention) == (2, 1, 2, True)
    view = s.attention_view()
    assert (view.tp_rank, view.tp_size, view.dp_size) == (1, 2, 1)
    plain = ParallelState(tp_rank=1, tp_size=2)
    assert (plain.attn_tp_size, plain.dp_rank, plain.attention_view()) == (2, 0, plain)
    with pytest.raises(ValueError, match="dp_size 3"):
        ParallelState(tp_rank=0, tp_size=4, dp_size=3)
    assert parallel_state().dp_size == 1


def test_heads_split_over_the_attention_group() -> None:
    cfg: ModelConfig = preset("k3-tiny")
    heads = cfg.kda_num_heads  # 2; intermediate_size 128
    check_tensor_parallel(cfg, 4 * heads, 1)  # attention replicated in each group: only the FFN splits 8 ways
    with pytest.raises(ConfigError, match="--tp 8 must divide kda_num_heads"):
        check_tensor_parallel(cfg, 4 * heads)
    with pytest.raises(ConfigError, match="--tp / --dp = 4 must divide kda_num_heads"):
        check_tensor_parallel(cfg, 4 * heads, 4)
    dp = pool_layout(cfg, _args())
    tp = pool_layout(cfg, ServerArgs(tp_size=WORLD, mem_bytes=POOL_BYTES))
    assert (dp.kda_heads, tp.kda_heads) == (heads, heads // WORLD)
