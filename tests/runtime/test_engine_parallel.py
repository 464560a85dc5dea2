"""The multi-process Engine past one rank: greedy tokens with --tp 2 (radix on), --tp 2 --ep 2, --tp 2 --dp 2
--enable-dp-attention and two loopback "nodes" (node 1 a `radixk3 serve --node-rank 1` subprocess), each also
with n-gram and with MTP speculation (MTP also over --dp 2 replicas), --tp 4 --dp 2 --enable-dp-attention
(attention groups of two ranks), and DP attention with the draft-model and DSpark proposers, are identical, token
for token, to --tp 1 over the exactness prompt set. The --tp 1 side is the same runtime in one process (LocalEngine,
itself checked against the no-cache greedy loop in
test_engine_exactness)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixk3.checkpoint import load_model, write_checkpoint, write_random_checkpoint
from radixk3.config import PRESET_SEED, TINY_PRESET, preset
from radixk3.dspark_checkpoint import write_random_dspark
from radixk3.model import KimiForCausalLM, build_model
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs
from runtime.tokenizer.engine import Engine
from runtime.topology import free_ports

MAX_NEW = 6
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
MEM = 8 << 20
ROOT = Path(__file__).resolve().parents[2]
Waves = list[list[list[int]]]


def _waves(model: KimiForCausalLM) -> tuple[Waves, Waves]:
    """test_engine_exactness's three waves (few-shot, shared system prompt, unrelated, duplicate; next turns that
    extend earlier outputs; branches inside a cached prefix), with the --tp 1 outputs of each."""
    ref = LocalEngine(ServerArgs(mem_bytes=MEM), model)
    g = random.Random(5)
    v = model.config.vocab_size

    def rand(n: int) -> list[int]:
        return [g.randrange(v) for _ in range(n)]

    shots = rand(48)
    system = rand(20)
    wave1 = [shots + rand(g.randrange(3, 12)) for _ in range(12)]
    wave1 += [system + rand(g.randrange(2, 30)) for _ in range(8)]
    wave1 += [rand(g.randrange(5, 60)) for _ in range(4)]
    wave1.append(list(wave1[0]))
    ref1 = ref.generate(wave1, GREEDY)
    wave2 = [p + o + rand(g.randrange(1, 9)) for p, o in zip(wave1[:14], ref1[:14], strict=True)]
    wave2 += [p + o for p, o in zip(wave1[14:20], ref1[14:20], strict=True)]
    wave2 += [shots[: g.randrange(10, 48)] + rand(4) for _ in range(6)]
    wave3 = [list(p) for p in wave2[:6]] + [shots + rand(3) for _ in range(4)]
    return [wave1, wave2, wave3], [ref1, ref.generate(wave2, GREEDY), ref.generate(wave3, GREEDY)]


@pytest.fixture(scope="module")
def builtin() -> tuple[Waves, Waves]:
    return _waves(build_model(preset(TINY_PRESET), seed=PRESET_SEED))


@pytest.fixture(scope="module")
def native_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Waves, Waves]:
    """A k3-tiny-native checkpoint (it has an MTP layer; k3-tiny has none) and its --tp 1 outputs."""
    out = write_random_checkpoint(preset("k3-tiny-native"), tmp_path_factory.mktemp("native"), seed=12)
    model = load_model(out)
    assert model.config.num_nextn_predict_layers >= 1
    waves, refs = _waves(model)
    return out, waves[:2], refs[:2]


def _run(engine: Engine, waves: Waves) -> Waves:
    return [[r["output_ids"] for r in engine.generate(wave, GREEDY, timeout=120)] for wave in waves]


def _all_gone(engine: Engine) -> None:
    engine.shutdown()
    assert not any(p.is_alive() for p in engine.procs.procs)


CONFIGS = {
    "tp2": dict(tp_size=2),
    "tp2_ep2": dict(tp_size=2, ep_size=2),
    "tp2_ngram": dict(tp_size=2, speculative_algorithm="ngram"),
    "tp2_ep2_ngram": dict(tp_size=2, ep_size=2, speculative_algorithm="ngram"),
    # DP attention: two attention groups of one rank, each with its own requests, radix tree and pool.
    "tp2_dp2_attention": dict(tp_size=2, dp_size=2, enable_dp_attention=True),
    "tp2_dp2_attention_ngram": dict(tp_size=2, dp_size=2, enable_dp_attention=True, speculative_algorithm="ngram",
                                    load_balance_method="cache_aware"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_greedy_equals_tp1(name: str, builtin: tuple[Waves, Waves]) -> None:
    waves, refs = builtin
    engine = Engine(mem_bytes=MEM, **CONFIGS[name])
    try:
        assert engine.procs.num_replicas == 1 and len(engine.procs.ranks) == 2
        assert _run(engine, waves) == refs
        m = engine.get_metrics()
        assert m["cached_tokens"] > 0  # the radix cache is on and hit
        if engine.args.enable_dp_attention:  # both DP ranks served, and their counters add up
            per = m["dp_ranks"]
            assert len(per) == 2 and all(d["prompt_tokens"] > 0 for d in per)
            assert sum(d["decode_tokens"] for d in per) == m["decode_tokens"]
        if engine.args.speculative_algorithm is not None:
            assert m["verify_steps"] > 0 and m["draft_tokens"] > 0  # drafts verified (random weights accept few)
    finally:
        _all_gone(engine)


MTP_CONFIGS = {"tp2": dict(tp_size=2), "tp2_ep2": dict(tp_size=2, ep_size=2),
               "tp2_dp2_attention": dict(tp_size=2, dp_size=2, enable_dp_attention=True),
               "dp2_replicas": dict(dp_size=2, load_balance_method="round_robin")}


@pytest.mark.parametrize("name", sorted(MTP_CONFIGS))
def test_mtp_greedy_equals_tp1(name: str, native_mtp: tuple[Path, Waves, Waves]) -> None:
    ckpt, waves, refs = native_mtp
    engine = Engine(str(ckpt), mem_bytes=MEM, speculative_algorithm="mtp", **MTP_CONFIGS[name])
    try:
        assert _run(engine, waves) == refs
        m = engine.get_metrics()
        assert m["verify_steps"] > 0 and m["draft_tokens"] > 0
    finally:
        _all_gone(engine)


def test_dp_attention_groups_of_two_ranks_equal_tp1(builtin: tuple[Waves, Waves],
                                                     native_mtp: tuple[Path, Waves, Waves]) -> None:
    """--tp 4 --dp 2 --enable-dp-attention: two attention groups of two ranks each (the layout the README plans
    at scale, attention tensor-parallel inside each group), k3-tiny plain and k3-tiny-native with MTP."""
    ckpt, native_waves, native_refs = native_mtp
    runs = ((dict(), *builtin), (dict(model=str(ckpt), speculative_algorithm="mtp"), native_waves, native_refs))
    for extra, waves, refs in runs:
        engine = Engine(mem_bytes=MEM, tp_size=4, dp_size=2, enable_dp_attention=True, **extra)
        try:
            assert len(engine.procs.ranks) == 4 and engine.procs.topology.attention_groups == 2
            assert _run(engine, waves) == refs
            m = engine.get_metrics()
            assert len(m["dp_ranks"]) == 2 and all(d["prompt_tokens"] > 0 for d in m["dp_ranks"])
            assert m["cached_tokens"] > 0
            if "speculative_algorithm" in extra:
                assert m["verify_steps"] > 0 and m["draft_tokens"] > 0
        finally:
            _all_gone(engine)


NODE_FLAGS = {  # with DP attention and n-gram speculation, each node holds one DP rank
    "tp2": dict(),
    "tp2_dp2_attention_ngram": dict(dp_size=2, enable_dp_attention=True, speculative_algorithm="ngram"),
    "tp2_mtp": dict(speculative_algorithm="mtp"),  # on the native checkpoint (the built-in model has no MTP)
}


@pytest.mark.parametrize("name", sorted(NODE_FLAGS))
def test_two_loopback_nodes_equal_tp1(name: str, request: pytest.FixtureRequest) -> None:
    extra = dict(NODE_FLAGS[name])
    if extra.get("speculative_algorithm") == "mtp":
        ckpt, waves, refs = request.getfixturevalue("native_mtp")
        extra["model"] = str(ckpt)
    else:
        waves, refs = request.getfixturevalue("builtin")
    base = free_ports(4)  # one replica of 2 ranks: rendezvous, 2 plan sockets, 1 result socket
    flags = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{base}", "--mem-bytes", str(MEM)]
    flags += [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in extra.items()]
    node1 = subprocess.Popen([sys.executable, "-m", "radixk3.cli", "serve", *flags, "--node-rank", "1"], cwd=ROOT,
                             env=os.environ | {"PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    try:
        engine = Engine(mem_bytes=MEM, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{base}",
                        **extra)
        try:
            assert [rid.rank for rid in engine.procs.ranks] == [0]  # node 0 runs rank 0 only
            assert _run(engine, waves) == refs
            m = engine.get_metrics()
            if "enable_dp_attention" in extra:
                assert all(d["prompt_tokens"] > 0 for d in m["dp_ranks"])
            if "speculative_algorithm" in extra:
                assert m["verify_steps"] > 0
        finally:
            _all_gone(engine)
        _, err = node1.communicate(timeout=30)  # node 0's Shutdown ends node 1 cleanly
        assert node1.returncode == 0, err[-2000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(timeout=10)


def test_node1_exits_when_node0_goes_away() -> None:
    """Node 0's scheduler killed: node 1's rank sees its plan socket close and exits, leaving nothing behind."""
    base = free_ports(4)
    flags = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{base}", "--mem-bytes", str(MEM)]
    node1 = subprocess.Popen([sys.executable, "-m", "radixk3.cli", "serve", *flags, "--node-rank", "1"], cwd=ROOT,
                             env=os.environ | {"PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    try:
        engine = Engine(mem_bytes=MEM, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{base}")
        try:
            sched = engine.procs.procs[-1]
            os.kill(sched.pid, 9)
            start = time.monotonic()
            _, err = node1.communicate(timeout=30)
            assert node1.returncode != 0 and time.monotonic() - start < 30
            assert "node 0 went away" in err
            engine.procs.watcher.join(timeout=10)
            assert engine.procs.dead is not None
        finally:
            _all_gone(engine)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(timeout=10)


def _drafter(alg: str, root: Path) -> Path:
    """A random draft model (k3-tiny, another seed) or DSpark drafter for the built-in target."""
    if alg == "draft":
        return write_checkpoint(build_model(preset("k3-tiny"), seed=5), root / "draft")
    return write_random_dspark(root / "dspark", build_model(preset(TINY_PRESET), seed=PRESET_SEED), seed=2)


@pytest.mark.parametrize("alg", ["draft", "dspark"])
def test_dp_attention_with_a_draft_model_or_dspark_equals_tp1(alg: str, builtin: tuple[Waves, Waves],
                                                              tmp_path: Path) -> None:
    """Each DP rank drafts for its own windows. The draft model's forwards run the shared FFN's collectives: every
    step each rank runs as many (joining on zero rows) whatever its mode; DSpark's drafter runs none across ranks.
    Besides the waves, a long request decodes on rank 0 while a later one prefills, decodes and ends on rank 1, so
    ranks verify, extend and idle against each other."""
    waves, refs = builtin
    target = build_model(preset(TINY_PRESET), seed=PRESET_SEED)
    longer = dict(GREEDY, max_new_tokens=40)
    g = random.Random(9)
    first, later = [g.randrange(target.config.vocab_size) for _ in range(30)], [3, 1, 4, 1, 5, 9, 2, 6]
    ref = LocalEngine(ServerArgs(mem_bytes=MEM), target)
    want = ref.generate([first], longer)[0], ref.generate([later], GREEDY)[0]
    engine = Engine(mem_bytes=MEM, tp_size=2, dp_size=2, enable_dp_attention=True, load_balance_method="round_robin",
                    speculative_algorithm=alg, speculative_draft_model=str(_drafter(alg, tmp_path)))
    try:
        assert _run(engine, waves) == refs
        got, after = [], None
        for n, chunk in enumerate(engine.stream(first, longer, timeout=120)):
            got += chunk.token_ids
            if n == 2:  # round robin: the next request goes to the other DP rank
                after = engine.generate([later], GREEDY, timeout=120)[0]["output_ids"]
        assert (got, after) == want
        m = engine.get_metrics()
        assert m["verify_steps"] > 0 and m["draft_tokens"] > 0
        assert all(d["verify_steps"] > 0 for d in m["dp_ranks"])  # both DP ranks drafted
    finally:
        _all_gone(engine)
