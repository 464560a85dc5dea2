"""The same programs against a live `radixk3.launch_server` through `RuntimeEndpoint` (the native /generate
API over HTTP): gen with stops, select against the no-cache forward (text only on the client: the prefix's
last token tells where each choice begins), fork's cached prefix, run_batch order, streaming, the server's
error messages, and bench/gsm8k.py against the server."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

import frontend_lang as sgl
from radixk3.config import PRESET_SEED
from radixk3.tokenizer import load_tokenizer
from tests.bench.test_bench_smoke import bench, last_json
from tests.frontend_lang.oracle import choice_logprobs, tiny_model
from tests.frontend_lang.programs import (
    CHOICES,
    MERGING_CHOICES,
    MERGING_PREFIX,
    PREFIX,
    check_constrained,
    constrained,
    fork_and_append,
    numbered,
    pick,
    plain_gen,
    with_regex,
)
from tests.runtime.http_server_proc import Server


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


@pytest.fixture(scope="module")
def endpoint(server: Server) -> Iterator[sgl.RuntimeEndpoint]:
    ep = sgl.RuntimeEndpoint(server.url)
    yield ep
    ep.shutdown()


def test_gen_with_a_stop_string(endpoint: sgl.RuntimeEndpoint) -> None:
    free = plain_gen.run(prompt=PREFIX, temperature=0, backend=endpoint)["out"]
    stop = free[4:7]
    state = plain_gen.run(prompt=PREFIX, stop=[stop], temperature=0, backend=endpoint)
    assert state["out"] == free[: free.index(stop)]
    assert state.get_meta_info("out")["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.parametrize(("prefix", "choices"), [(PREFIX, CHOICES), (MERGING_PREFIX, MERGING_CHOICES)])
def test_select_matches_the_no_cache_forward(endpoint: sgl.RuntimeEndpoint, prefix: str, choices: list[str]) -> None:
    model, tok = tiny_model(PRESET_SEED), load_tokenizer()
    truth = [choice_logprobs(model, tok, prefix, c) for c in choices]
    means = [sum(t) / len(t) for t in truth]
    state = pick.run(prefix=prefix, choices=choices, backend=endpoint)
    meta = state.get_meta_info("pick")
    for got, want in zip(meta["input_token_logprobs"], truth, strict=True):
        assert [lp for lp, _ in got] == pytest.approx(want, abs=1e-4)
    assert state["pick"] == choices[means.index(max(means))]
    sums = [sum(t) for t in truth]
    assert pick.run(prefix=prefix, choices=choices, method=sgl.unnormalized, backend=endpoint)["pick"] == \
        choices[sums.index(max(sums))]
    assert all(c > 0 for c in meta["cached_tokens"])


def test_fork_branches_find_the_cached_prefix(endpoint: sgl.RuntimeEndpoint) -> None:
    prefix = PREFIX * 2 + "Answer:"
    n_prefix = len(load_tokenizer().encode(prefix, add_bos=True))
    state = fork_and_append.run(prefix=prefix, temperature=0, backend=endpoint)
    assert all(m["cached_tokens"] >= n_prefix - 1 for m in state.ret_value)
    assert state.text() == prefix + "".join(state["parts"])


def test_run_batch_in_order_and_streaming(endpoint: sgl.RuntimeEndpoint) -> None:
    states = numbered.run_batch([{"i": i} for i in range(5)], temperature=0, backend=endpoint, num_threads=5)
    assert [s.text().split(":")[0] for s in states] == [f"Question {i}" for i in range(5)]
    assert states[3]["answer"] == numbered.run(i=3, temperature=0, backend=endpoint)["answer"]
    whole = plain_gen.run(prompt=PREFIX, temperature=0, backend=endpoint)["out"]
    streamed = plain_gen.run(prompt=PREFIX, temperature=0, stream=True, backend=endpoint)
    pieces = list(streamed.text_iter("out"))
    assert len(pieces) > 2 and "".join(pieces) == whole


def test_server_errors_raise_with_the_servers_message(endpoint: sgl.RuntimeEndpoint) -> None:
    with pytest.raises(sgl.BackendError, match="temperature") as err:
        plain_gen.run(prompt="x", temperature=-1.0, backend=endpoint)
    assert err.value.status == 400
    with pytest.raises(sgl.BackendError, match="invalid regex"):  # the grammar backend's message
        constrained.run(regex="[0-9", backend=endpoint)
    assert with_regex.run(backend=endpoint)["n"].isdigit()
    streamed = plain_gen.run(prompt="x", temperature=-1.0, stream=True, backend=endpoint)
    with pytest.raises(sgl.BackendError, match="temperature"):
        list(streamed.text_iter())
    with pytest.raises(sgl.BackendError, match="cannot reach"):
        plain_gen.run(prompt="x", backend=sgl.RuntimeEndpoint("http://127.0.0.1:9"))


def test_gsm8k_against_the_server(server: Server, capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # noqa: ANN001
    url = urlsplit(server.url)
    assert bench("gsm8k").main(["--backend", "srt", "--host", f"http://{url.hostname}", "--port", str(url.port),
                                "--num-questions", "20", "--max-new-tokens", "4", "--json", "--no-progress",
                                "--result-file", str(tmp_path / "r.jsonl")]) == 0
    out = last_json(capsys)
    assert out["cache_hit_rate"] > 0.8 and out["output_tokens"] > 0  # the server's cached_tokens per request


def test_gen_regex_and_json_schema_outputs_match(endpoint: sgl.RuntimeEndpoint) -> None:
    check_constrained(endpoint)
