"""End to end through the scheduler and worker: greedy outputs equal the plain no-cache greedy loop, token
for token, with the radix cache on and off, page sizes 1 and 16, chunked prefill, overlap on (the default)
and off, mixed prefill/decode steps (the default) and unmixed ones, a shared prefill budget, and a pool small
enough to force eviction, compaction and retraction."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from radixk3.config import preset
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs
from tests.greedy import greedy_reference

MAX_NEW = 6
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=11)


def _waves(model, reference: Callable[[list[list[int]]], list[list[int]]] | None = None) -> list[list[list[int]]]:  # noqa: ANN001
    """Three waves of prompts sharing prefixes in several patterns; later waves extend earlier outputs (the
    plain greedy loop's, or `reference`'s: an engine already shown equal to it, which is faster)."""
    g = random.Random(5)
    v = model.config.vocab_size

    def rand(n: int) -> list[int]:
        return [g.randrange(v) for _ in range(n)]

    shots = rand(48)
    system = rand(20)
    wave1 = [shots + rand(g.randrange(3, 12)) for _ in range(12)]  # few-shot
    wave1 += [system + rand(g.randrange(2, 30)) for _ in range(8)]  # shared system prompt
    wave1 += [rand(g.randrange(5, 60)) for _ in range(4)]  # unrelated
    wave1.append(list(wave1[0]))  # exact duplicate
    ref1 = reference(wave1) if reference is not None else [greedy_reference(model, p, MAX_NEW) for p in wave1]
    wave2 = [p + o + rand(g.randrange(1, 9)) for p, o in zip(wave1[:14], ref1[:14], strict=True)]  # next turn
    wave2 += [p + o for p, o in zip(wave1[14:20], ref1[14:20], strict=True)]  # prompt = earlier prompt + output
    wave2 += [shots[: g.randrange(10, 48)] + rand(4) for _ in range(6)]  # branch inside a cached prefix
    wave3 = [list(p) for p in wave2[:6]] + [shots + rand(3) for _ in range(4)]
    return [wave1, wave2, wave3]


def _waves_and_refs(model) -> tuple[list[list[list[int]]], list[list[list[int]]]]:  # noqa: ANN001
    """The waves and the no-cache loop's outputs for each; wave 1's, which `_waves` extends, computed once."""
    ref1: list[list[int]] = []

    def first(wave: list[list[int]]) -> list[list[int]]:
        ref1.extend(greedy_reference(model, p, MAX_NEW) for p in wave)
        return ref1

    waves = _waves(model, first)
    return waves, [ref1] + [[greedy_reference(model, p, MAX_NEW) for p in wave] for wave in waves[1:]]


@pytest.fixture(scope="module")
def workload(model):  # noqa: ANN001, ANN201
    return _waves_and_refs(model)


CONFIGS = {
    "radix": dict(),
    "no_radix": dict(disable_radix_cache=True),
    "page16_chunked": dict(page_size=16, chunked_prefill_size=32),
    "chunked_mid_prompt": dict(chunked_prefill_size=23, decode_checkpoint_interval=4),
    "no_overlap_chunked": dict(chunked_prefill_size=23, decode_checkpoint_interval=4, disable_overlap_schedule=True),
    # Running decodes ride in every extend step by default (mixed chunk): this config turns that off.
    "unmixed": dict(chunked_prefill_size=23, enable_mixed_chunk=False),
    # The step's prefill budget shared between running chunks and admissions.
    "shared_budget": dict(chunked_prefill_size=16, max_prefill_tokens=40),
    # Admission reserves no decode tokens here (conservativeness 0), so decoding outgrows the pool: retraction.
    # Unmixed, every admitted request starts decoding at once when the prefill work is done, which is what
    # overflows the pool with these 6-token outputs; mixed steps retract with longer outputs
    # (test_engine_fair_prefill.py).
    "tiny_pool": dict(mem_bytes=300_000, chunked_prefill_size=40, decode_checkpoint_interval=3,
                      schedule_conservativeness=0.0, enable_mixed_chunk=False),
    "tiny_pool_mixed": dict(mem_bytes=300_000, chunked_prefill_size=40, decode_checkpoint_interval=3,
                            schedule_conservativeness=0.0),
    "tiny_pool_page16": dict(mem_bytes=300_000, page_size=16, chunked_prefill_size=48),
    # Decode windows (--num-scheduler-steps): several decode steps per plan, checkpoints inside them, overlap off
    # and on, and a pool small enough that windows retract.
    "windows": dict(num_scheduler_steps=4, decode_checkpoint_interval=3, chunked_prefill_size=23),
    "windows_page4_no_overlap": dict(num_scheduler_steps=5, page_size=4, decode_checkpoint_interval=2,
                                     disable_overlap_schedule=True),
    "windows_tiny_pool": dict(num_scheduler_steps=4, mem_bytes=300_000, chunked_prefill_size=40,
                              decode_checkpoint_interval=3, schedule_conservativeness=0.0, enable_mixed_chunk=False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_outputs_equal_reference(name: str, model, workload) -> None:  # noqa: ANN001
    waves, refs = workload
    assert sum(len(w) for w in waves) >= 50
    args = ServerArgs(**CONFIGS[name])
    eng = LocalEngine(args, model, check=True)
    for wave, ref in zip(waves, refs, strict=True):
        assert eng.generate(wave, GREEDY) == ref
    m = eng.scheduler.metrics
    assert (m.mixed_steps > 0) == args.enable_mixed_chunk  # the default path, mixed steps, really ran
    if name != "no_radix":
        assert m.cached_tokens > 0 and m.state_hits > 0
    if name.startswith("tiny_pool"):
        # The pool really was under pressure on both resources.
        assert m.evictions > 0 and eng.scheduler.pool.usage().compaction_moves > 0
    if name in ("tiny_pool", "windows_tiny_pool"):
        assert m.retractions > 0
    if name.startswith("windows"):  # windows really ran: more decode steps than plans of them
        assert m.decode_steps > m.steps - m.extend_steps
    assert not eng.scheduler.running and not eng.scheduler.waiting


@pytest.fixture(scope="module")
def native():  # noqa: ANN201
    m = build_model(preset("k3-tiny-native"), seed=12)
    return m, *_waves_and_refs(m)


@pytest.mark.parametrize("name", ["radix", "page16_chunked", "tiny_pool"])
def test_native_k3_greedy_outputs_equal_reference(name: str, native) -> None:  # noqa: ANN001
    """The same runtime drives a native K3 model (AttnRes, gated MLA, safe/full-rank gates, LatentMoE)."""
    model, waves, refs = native
    eng = LocalEngine(ServerArgs(**CONFIGS[name]), model, check=True)
    for wave, ref in zip(waves, refs, strict=True):
        assert eng.generate(wave, GREEDY) == ref
