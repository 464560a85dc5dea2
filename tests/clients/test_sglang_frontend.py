"""SGLang's own frontend language (`sglang` 0.5.23 from PyPI, unchanged: `sgl.RuntimeEndpoint`,
`sgl.set_default_backend`) against one live radixk3 server on the built-in model.

Each feature is checked against the server's own answer to the same text (greedy over `/generate`) or against
the no-cache forward: `gen` with stops, `regex`, `select`, `fork` / `join`, roles, `run_batch`,
streaming with logprobs, `get_server_info()`. Then SGLang's own frontend test programs
(`sglang.test.test_programs`, the ones its test_srt_backend runs and the rest of that module) run unchanged;
`SKIPPED` says which are not run and why (a trained model's answers, a vision model, OpenAI-only features, a
race inside the client).
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sglang as sgl
from sglang.test import test_programs as sgl_programs

from radixk3.config import PRESET_SEED
from radixk3.tokenizer import load_tokenizer
from tests.frontend_lang.oracle import tiny_model, token_logprobs
from tests.runtime.http_server_proc import Server

PREFIX = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\n"
PHONE = r"[0-9]{3}-[0-9]{4}"
PROMPTS = ["Weng earns $12 an hour", "Betty is saving money", "Julie is reading a 120-page book"]

# SGLang's programs that are not run, and why. Every `test_*` function of sglang.test.test_programs is either
# here or in RUN (test_every_sglang_program_is_run_or_skipped), so a new one is never missed silently.
SKIPPED = {
    "test_few_shot_qa": "asserts a trained model's answers (Washington, Tokyo, London, Beijing)",
    "test_decode_int": "asserts a trained model's answers (24 hours, 365 days)",
    "test_tool_use": "evaluates the generated expression with eval() and asserts the product: a trained model's answer",
    "test_react": "asserts a trained model's answer (Finland or the States)",
    "test_decode_json": "parses the output as JSON: only a model that closes its string (REGEX_STR) within "
                        "max_new_tokens makes one, a random model does not",
    "test_decode_json_regex": "parses the output as JSON: only a model that closes its string (REGEX_STR) within "
                              "max_new_tokens makes one, a random model does not",
    "test_image_qa": "needs a vision model and an image file (example_image.png) and asserts its description",
    "test_completion_speculative": "API speculative execution of OpenAI-style backends (backend.token_usage); "
                                   "RuntimeEndpoint has none",
    "test_chat_completion_speculative": "API speculative execution of OpenAI-style chat backends "
                                        "(backend.is_chat_model); RuntimeEndpoint has none, the program fails in "
                                        "its executor thread and the test returns without checking anything",
    "test_gen_min_new_tokens": "loads the tokenizer through sglang.srt.utils.hf_transformers_utils, which imports "
                               "SGLang's model configs and torchvision (not installable beside the CPU torch)",
    "test_stream_logprobs": "its per-chunk count check races inside the frontend: the executor thread overwrites "
                            "meta_info at each stream event while the text accumulates, so when two events come "
                            "before the async reader wakes (a loaded machine), the chunk's text covers both and "
                            "its logprobs only the last, against any server; test_stream_with_logprobs checks the "
                            "same fields without the race",
}
# Run as SGLang's test_srt_backend runs them, but all at once; check_answer=False where a program offers it (the
# answer is a trained model's). test_parallel_encoding joins with the frontend's text concatenation
# (global_config.enable_parallel_encoding = False): its KV-cache join posts /concate_and_append_request, a route
# SGLang 0.5.23's own server does not have either.
RUN = ["test_select", "test_mt_bench", "test_expert_answer", "test_regex", "test_dtype_gen", "test_stream",
       "test_parallel_decoding", "test_parallel_encoding"]


@pytest.fixture(scope="module")
def backend(server: Server) -> Iterator[sgl.RuntimeEndpoint]:
    be = sgl.RuntimeEndpoint(server.url)
    sgl.set_default_backend(be)
    yield be
    sgl.set_default_backend(None)


def native(server: Server, text: str, max_new_tokens: int, **params: Any) -> dict[str, Any]:
    """The server's own greedy answer to `text` over /generate."""
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0} | params
    with server.client() as c:
        r = c.post("/generate", json={"text": text, "sampling_params": sp, "return_logprob": True})
    r.raise_for_status()
    return r.json()


@sgl.function
def continue_text(s, prompt: str, stop: list[str] | None = None, max_tokens: int = 12):  # noqa: ANN001, ANN201
    s += prompt + sgl.gen("out", max_tokens=max_tokens, stop=stop)


@sgl.function
def typed(s, prompt: str):  # noqa: ANN001, ANN201
    s += prompt + "Phone: " + sgl.gen("phone", regex=PHONE) + "\n"


@sgl.function
def pick(s, prefix: str, choices: list[str]):  # noqa: ANN001, ANN201
    s += prefix + sgl.select("pick", choices=choices)


@sgl.function
def forked(s, prompt: str):  # noqa: ANN001, ANN201
    s += prompt
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Option {i}:" + sgl.gen("option", max_tokens=6)
    forks.join()
    s += "Chosen:" + forks[1]["option"]
    s.set_var("options", [f["option"] for f in forks])


@sgl.function
def chat(s, question: str):  # noqa: ANN001, ANN201
    s += sgl.system("You answer briefly.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


def test_model_info_and_server_info(server: Server, backend: sgl.RuntimeEndpoint) -> None:
    with server.client() as c:
        model_info = c.get("/model_info").json()
    assert backend.get_model_name() == model_info["model_path"] == "k3-tiny"
    info = sgl.get_server_info()
    assert info["model_path"] == "k3-tiny" and info["served_model_name"] == "k3-tiny"
    assert isinstance(info["tokenizer_path"], str)


def test_gen_with_stops(server: Server, backend: sgl.RuntimeEndpoint) -> None:
    free = native(server, PREFIX, 12)["text"]
    stop = free[4:7]
    state = continue_text.run(prompt=PREFIX, stop=[stop, "never in the output"], temperature=0)
    assert state["out"] == free[: free.index(stop)]
    assert state.get_meta_info("out")["finish_reason"] == {"type": "stop", "matched": stop}
    assert state.text() == PREFIX + state["out"]
    assert continue_text.run(prompt=PREFIX, temperature=0)["out"] == free


def test_regex(server: Server, backend: sgl.RuntimeEndpoint) -> None:
    state = typed.run(prompt=PREFIX, temperature=0)
    assert re.fullmatch(PHONE, state["phone"])
    assert state["phone"] == native(server, PREFIX + "Phone: ", 128, regex=PHONE)["text"]


def test_select_matches_the_no_cache_forward(backend: sgl.RuntimeEndpoint) -> None:
    """SGLang's select scores each choice by its tokens' logprobs from the server (with its own token-healing
    trim); each of those equals the no-cache forward, and the pick is the best normalised one."""
    choices = [" yes", " she sold 72 clips", " no"]
    state = pick.run(prefix=PREFIX, choices=choices, temperature=0)
    meta = state.get_meta_info("pick")
    model, tok = tiny_model(PRESET_SEED), load_tokenizer()
    for choice, got in zip(choices, meta["input_token_logprobs"], strict=True):
        ids = tok.encode(PREFIX + choice, add_bos=True)
        start = len(ids) - len(got)
        assert [t for _, t, _ in got] == ids[start:]
        assert [lp for lp, _, _ in got] == pytest.approx(token_logprobs(model, ids, start), abs=1e-4)
    normalized = meta["normalized_prompt_logprobs"]
    assert state["pick"] == choices[normalized.index(max(normalized))]


def test_fork_and_join(server: Server, backend: sgl.RuntimeEndpoint) -> None:
    state = forked.run(prompt=PREFIX, temperature=0)
    options = state["options"]
    assert options == [native(server, PREFIX + f"Option {i}:", 6)["text"] for i in range(2)]
    assert state.text() == PREFIX + "Chosen:" + options[1]


def test_roles(server: Server, backend: sgl.RuntimeEndpoint) -> None:
    state = chat.run(question="How many clips?", temperature=0)
    answer = state["answer"]
    assert [(m["role"], m["content"]) for m in state.messages()] == [
        ("system", "You answer briefly."), ("user", "How many clips?"), ("assistant", answer)]
    # The client renders the roles with the chat template it picked by model_path; the server continues it.
    text = state.text()
    prompt = text[: text.rindex(answer)] if answer else text
    assert answer == native(server, prompt, 8)["text"]


def test_run_batch_in_order(server: Server, backend: sgl.RuntimeEndpoint) -> None:
    states = continue_text.run_batch([{"prompt": p, "max_tokens": 8} for p in PROMPTS], temperature=0,
                                     num_threads=len(PROMPTS))
    assert [s["out"] for s in states] == [native(server, p, 8)["text"] for p in PROMPTS]


def test_stream_with_logprobs(server: Server, backend: sgl.RuntimeEndpoint) -> None:
    """Streamed chunks add up to the whole text; each chunk's meta_info (SGLang's incremental stream) holds the
    logprobs of the tokens that end at its completion_tokens, equal to the non-streamed ones."""

    @sgl.function
    def scored(s):  # noqa: ANN001, ANN202
        s += PREFIX + sgl.gen("out", max_tokens=12, return_logprob=True)

    whole = scored.run(temperature=0)
    full = whole.get_meta_info("out")["output_token_logprobs"]
    assert [t for _, t, _ in full] == native(server, PREFIX, 12)["output_ids"]

    async def chunks() -> list[tuple[str, dict[str, Any]]]:
        state = scored.run(temperature=0, stream=True)
        return [c async for c in state.text_async_iter("out", return_meta_data=True)]

    got = asyncio.run(chunks())
    assert len(got) > 1 and "".join(text for text, _ in got) == whole["out"]
    for _, meta in got:
        n, new = meta["completion_tokens"], meta["output_token_logprobs"]
        assert meta["output_token_logprobs_length"] == n and len(new) <= n
        assert [t for _, t, _ in new] == [t for _, t, _ in full[n - len(new): n]]
        assert [lp for lp, _, _ in new] == pytest.approx([lp for lp, _, _ in full[n - len(new): n]], abs=1e-5)
    assert got[-1][1]["completion_tokens"] == len(full) and any(meta["output_token_logprobs"] for _, meta in got)


def test_every_sglang_program_is_run_or_skipped() -> None:
    programs = {name for name, f in vars(sgl_programs).items() if name.startswith("test_") and callable(f)}
    assert programs == set(RUN) | set(SKIPPED) and not set(RUN) & set(SKIPPED)


@pytest.fixture(scope="module")
def program_errors(backend: sgl.RuntimeEndpoint) -> dict[str, Exception | None]:
    """Each program of RUN run once, all at the same time (the server batches them): its exception or None."""

    def run(name: str) -> Exception | None:
        program = getattr(sgl_programs, name)
        kwargs = {"check_answer": False} if "check_answer" in inspect.signature(program).parameters else {}
        try:
            program(**kwargs)
        except Exception as e:  # raised again by the program's own test
            return e
        return None

    saved = sgl.global_config.enable_parallel_encoding
    sgl.global_config.enable_parallel_encoding = False
    try:
        with ThreadPoolExecutor(len(RUN)) as pool:
            return dict(zip(RUN, pool.map(run, RUN), strict=True))
    finally:
        sgl.global_config.enable_parallel_encoding = saved


@pytest.mark.parametrize("name", RUN + [pytest.param(n, marks=pytest.mark.skip(reason=why))
                                        for n, why in SKIPPED.items()])
def test_sglang_program(name: str, program_errors: dict[str, Exception | None]) -> None:
    if (error := program_errors[name]) is not None:
        raise error


def test_server_errors_reach_the_program(backend: sgl.RuntimeEndpoint) -> None:
    """A refused request ends the program with the server's message (the client raises it in its executor)."""
    with pytest.warns(UserWarning, match="Error in stream_executor"):
        state = continue_text.run(prompt=PREFIX, temperature=-1.0)
        error = state.error()
    assert "temperature must be in" in str(error)
    with pytest.raises(KeyError):
        state["out"]
