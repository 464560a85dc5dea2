"""The engine with the Triton pool kernels (under the interpreter on CPU) running in place on the worker's real,
strided pool views: greedy outputs equal the plain no-cache loop. Small on purpose: the interpreter is slow."""

from __future__ import annotations

import random

import pytest

from radixk3.config import preset
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs
from tests.greedy import greedy_reference


@pytest.mark.parametrize("page_size", [1, 4])
def test_triton_pool_kernels_through_the_engine(page_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model(preset("k3-tiny"), seed=7)
    g = random.Random(page_size)
    v = model.config.vocab_size
    shared = [g.randrange(v) for _ in range(9)]
    prompts = [shared + [g.randrange(v) for _ in range(n)] for n in (3, 6)] + [[g.randrange(v) for _ in range(5)]]
    want = [greedy_reference(model, p, 4) for p in prompts]
    monkeypatch.setenv("RADIXK3_KERNELS", "triton")
    args = ServerArgs(page_size=page_size, mem_bytes=2 << 20, chunked_prefill_size=8, decode_checkpoint_interval=2)
    eng = LocalEngine(args, model, check=True)
    got = eng.generate(prompts, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert got == want
    # A repeat after the first wave hits the cache and still gives the same tokens.
    assert eng.generate(prompts[:1], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}) == want[:1]
