"""llama.cpp on the exported f32 GGUF (f32 KV cache, flash attention off) gives radixk3's greedy tokens: the
no-cache forward's, on prompts of several lengths decoded as parallel sequences, and on a burst run both ways
(its shared prefix decoded once and copied to every sequence; every prompt prefilled). Runs the bench's own path:
checkpoint -> GGUF -> llama.cpp in a child process. Needs llama-cpp-python (a bench extra): skipped without."""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import pytest
from greedy import greedy_reference

from bench.llamacpp.race import PREFILL_ALL, run_column
from bench.llamacpp.runner import available
from bench.weight_floor import token_bytes
from radixk3.checkpoint import load_model, write_random_checkpoint
from radixk3.config import preset

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

NEW = 4


class Workload(NamedTuple):
    name: str
    prompts: list[list[int]]
    new_tokens: int


def test_llamacpp_greedy_equals_radixk3(tmp_path: Path) -> None:
    cfg = preset("k3-tiny")  # grouped expert routing, both layer kinds, a dense lead layer
    ckpt = write_random_checkpoint(cfg, tmp_path / "ckpt", seed=11)
    model = load_model(ckpt)
    g = random.Random(5)
    ids = lambda n: [g.randrange(16, cfg.vocab_size) for _ in range(n)]  # noqa: E731
    prefix = ids(20)
    burst = Workload("burst", [prefix + ids(3) for _ in range(2)], NEW)
    plain = Workload("plain", [ids(n) for n in (1, 9, 17)], NEW)
    col = run_column(ckpt, "float32", [burst, plain], burst, cfg.vocab_size, 1, tmp_path, cfg.num_experts_per_token)
    runs = col.report.runs
    assert set(runs) == {"burst", "plain", "burst" + PREFILL_ALL}
    want = {w.name: [greedy_reference(model, p, NEW) for p in w.prompts] for w in (burst, plain)}
    for name, run in runs.items():
        assert run.outputs == want[name.removesuffix(PREFILL_ALL)], name
    assert col.gguf.file_type == "f32" and col.report.peak_rss_mib > 0 and col.report.system_info
    # The GGUF's bytes per batch-1 token are radixk3's fp32 count (plus the routers' correction biases, buffers).
    biases = 4 * cfg.num_experts * sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    assert col.bytes_per_token == token_bytes(cfg, 4).total + biases
