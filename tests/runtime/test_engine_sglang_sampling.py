"""SGLang's cheap sampling parameters through the real multi-process Engine (greedy or seeded, small):
`stop_regex`, `no_stop_trim`, `spaces_between_special_tokens`, `logit_bias` (against the no-cache ground truth),
`sampling_seed` and `stream_interval`."""

from __future__ import annotations

import re

import pytest
import torch

from radixk3.config import preset
from radixk3.model import build_model
from runtime.errors import InvalidRequest
from runtime.tokenizer.engine import Engine

PROMPT = "Natalia sold clips to"
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(builtin_engine: Engine) -> Engine:
    return builtin_engine


@pytest.fixture(scope="module")
def plain(engine: Engine) -> dict:
    out = engine.generate(PROMPT, GREEDY)
    assert len(out["text"]) > 12, "need a longer greedy text"
    return out


def _visible(text: str, at: int, n: int) -> str:
    """n characters of `text` from about `at` on, starting at a word character (a regex anchor to build on)."""
    for i in range(at, len(text) - n):
        if re.match(r"\w", text[i]) and text[i : i + n].strip():
            return text[i : i + n]
    raise AssertionError(f"no visible {n} characters past {at} in {text!r}")


def _streamed(engine: Engine, params: dict) -> tuple[str, list[list[int]], dict]:
    chunks = list(engine.stream(PROMPT, params))
    return "".join(c.text for c in chunks), [c.token_ids for c in chunks], chunks[-1]


@pytest.mark.parametrize("kind", ["bounded", "unbounded"])
def test_stop_regex_stops_and_trims_like_a_stop_string(engine: Engine, plain: dict, kind: str) -> None:
    text = plain["text"]
    sub = _visible(text, len(text) // 2, 3)
    pattern = re.escape(sub[0]) + "." + re.escape(sub[2]) if kind == "bounded" else re.escape(sub[:2]) + r"[\s\S]*"
    start = re.search(pattern, text).start()
    for params in (GREEDY | {"stop_regex": pattern}, GREEDY | {"stop_regex": [r"\A\Z never", pattern]}):
        cut = engine.generate(PROMPT, params)
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
        assert cut["text"] == text[:start]
        assert plain["output_ids"][: len(cut["output_ids"])] == cut["output_ids"]
        # Streamed: no chunk held a part of the match (the chunks add up to the trimmed text).
        streamed, _, last = _streamed(engine, params)
        assert streamed == text[:start] and last.matched_stop == pattern


def test_no_stop_trim_keeps_the_matched_stop(engine: Engine, plain: dict) -> None:
    text = plain["text"]
    stop = _visible(text, len(text) // 2, 3)
    tok = engine.tm.tokenizer
    for params in (GREEDY | {"stop": stop}, GREEDY | {"stop_regex": re.escape(stop)}):
        kept = engine.generate(PROMPT, params | {"no_stop_trim": True})
        assert kept["meta_info"]["finish_reason"]["type"] == "stop"
        assert kept["text"] == tok.decode(kept["output_ids"])  # every token's text, the stop's included
        assert kept["text"].startswith(text[: text.index(stop) + len(stop)])
        streamed, _, _ = _streamed(engine, params | {"no_stop_trim": True})
        assert streamed == kept["text"]
        assert engine.generate(PROMPT, params)["text"] == text[: text.index(stop)]
    # A stop token's text is kept as it is without the flag.
    stop_id = plain["output_ids"][3]
    by_id = engine.generate(PROMPT, GREEDY | {"stop_token_ids": [stop_id], "no_stop_trim": True})
    assert by_id["output_ids"] == plain["output_ids"][:4]
    assert by_id["text"] == tok.decode(plain["output_ids"][:4])


def test_spaces_between_special_tokens_decodes_as_a_fast_tokenizer(engine: Engine, plain: dict) -> None:
    tok = engine.tm.tokenizer
    for skip in (True, False):
        base = GREEDY | {"skip_special_tokens": skip}
        spaced = engine.generate(PROMPT, base | {"spaces_between_special_tokens": True})
        unspaced = engine.generate(PROMPT, base | {"spaces_between_special_tokens": False})
        assert (spaced["output_ids"], spaced["text"]) == (unspaced["output_ids"], unspaced["text"])
        assert unspaced["text"] == tok.decode(unspaced["output_ids"], skip_special_tokens=skip)


def test_sampling_seed_is_the_seed(engine: Engine) -> None:
    sampled = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    by_seed = engine.generate(PROMPT, sampled | {"seed": 7})["output_ids"]
    assert engine.generate(PROMPT, sampled | {"sampling_seed": 7})["output_ids"] == by_seed
    assert engine.generate(PROMPT, sampled | {"sampling_seed": 7, "seed": 7})["output_ids"] == by_seed
    assert engine.generate(PROMPT, sampled | {"sampling_seed": 8})["output_ids"] != by_seed
    with pytest.raises(InvalidRequest) as e:
        engine.generate(PROMPT, sampled | {"sampling_seed": 7, "seed": 8})
    assert e.value.param == "sampling_seed"


def test_stream_interval_batches_the_chunks(engine: Engine, plain: dict) -> None:
    text, ids, _ = _streamed(engine, GREEDY | {"stream_interval": 5})
    assert [t for c in ids for t in c] == plain["output_ids"] and text == plain["text"]
    sizes = [len(c) for c in ids if c]
    assert sizes[0] == 1 and all(s >= 5 for s in sizes[1:-1]) and len(sizes) <= 1 + -(-15 // 5)
    _, every, _ = _streamed(engine, GREEDY)
    assert len([c for c in every if c]) > len(sizes)


def test_a_result_read_whole_trims_at_the_stop_past_min_new_tokens(engine: Engine, plain: dict) -> None:
    """A stop string the output holds before min_new_tokens does not stop it; read whole (tokens held in chunks),
    the text is trimmed where the streamed one is, at a stop past min_new_tokens."""
    text, ids = plain["text"], plain["output_ids"]
    covering = [len(engine.tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)]

    def tokens_to(pos: int) -> int:  # output tokens whose text first covers character `pos`
        return next(n for n, c in enumerate(covering) if c > pos)

    def spaced(c: str) -> int | None:  # min_new_tokens past c's first occurrence (and the stop check's window)
        at = [i for i, x in enumerate(text) if x == c]
        return tokens_to(at[0]) + 2 if len(at) > 1 and tokens_to(at[-1]) >= tokens_to(at[0]) + 2 else None

    stop = next(c for c in text if c.isalpha() and spaced(c) is not None)
    params = GREEDY | {"stop": stop, "min_new_tokens": spaced(stop)}
    streamed, _, last = _streamed(engine, params)
    whole = engine.generate(PROMPT, params)
    assert last.finished == "stop" and len(streamed) > text.index(stop), (streamed, text)
    assert whole["text"] == streamed, (whole["text"], streamed)


def test_a_stop_completed_below_min_new_tokens_is_passed_in_a_stream_interval_chunk(engine: Engine,
                                                                                    plain: dict) -> None:
    """A stop string the output completes just below min_new_tokens (inside the stop check's window) does not stop
    it, and stays in the text: with stream_interval k the chunk crossing min_new_tokens holds it, and the text ends
    at the next occurrence, the one the scheduler matched; read whole, the text is the same."""
    text, ids = plain["text"], plain["output_ids"]
    covering = [len(engine.tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)]

    def token_of(pos: int) -> int:  # the output token whose text first covers character `pos`
        return next(n for n, c in enumerate(covering) if c > pos) - 1

    def occurrences(c: str) -> list[tuple[int, int]]:  # (position, token) of c's first character in each token
        return sorted({token_of(i): i for i, x in reversed(list(enumerate(text))) if x == c}.items(),
                      key=lambda t: t[0])

    # Tokens i < j of two occurrences of c with none between, i past the first chunk (token 0) and j >= i + 2.
    cases = [(c, i, j, pos) for c in dict.fromkeys(x for x in text if x.isalpha())
             for (i, _), (j, pos) in zip(occurrences(c), occurrences(c)[1:], strict=False) if i >= 1 and j >= i + 2]
    assert cases, f"no stop with two occurrences far enough apart in {text!r}"
    stop, i, j, pos = cases[0]
    # The first check (min_new_tokens, token i + 1) reads token i; the chunk [1, j] holds i and crosses it.
    params = GREEDY | {"stop": stop, "min_new_tokens": i + 2, "stream_interval": j}
    streamed, chunks, last = _streamed(engine, params)
    assert [t for c in chunks for t in c] == ids[: j + 1] and any(len(c) > j - i for c in chunks), chunks
    assert (last.finished, last.matched_stop) == ("stop", stop)
    assert streamed == text[:pos] and stop in streamed, (streamed, text[:pos])
    assert engine.generate(PROMPT, params)["text"] == text[:pos]


@torch.inference_mode()
def _biased_greedy(model: torch.nn.Module, prompt: list[int], bias: dict[int, float], n: int) -> list[int]:
    """Ground truth: the no-cache forward of the whole sequence for every token, the bias added to its logits."""
    seq, out = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor(seq, device=model.device))[-1].float()
        for t, b in bias.items():
            logits[t] += b
        out.append(int(logits.argmax()))
        seq.append(out[-1])
    return out


def test_logit_bias_changes_greedy_picks_as_on_the_ground_truth_logits(engine: Engine) -> None:
    model = build_model(preset("k3-tiny"), seed=engine.args.seed)
    prompt = engine.tm.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        first = model(torch.tensor(prompt, device=model.device))[-1].float()
    top = first.topk(3)
    runner_up, third = int(top.indices[1]), int(top.indices[2])
    gap = float(top.values[0] - top.values[1])
    # The runner-up overtakes the top pick at the first step; the third is pushed down everywhere.
    bias = {runner_up: gap + 1.0, third: -50.0}
    n = 8
    want = _biased_greedy(model, prompt, bias, n)
    assert want[0] == runner_up and third not in want
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    got = engine.generate(prompt, params | {"logit_bias": {str(t): b for t, b in bias.items()}},
                          return_logprob=True)
    assert got["output_ids"] == want
    assert engine.generate(prompt, params)["output_ids"] != want
    # Logprobs stay those of the model's own distribution (the bias changes the draw only), within the served
    # logprobs' tolerance against the no-cache forward.
    raw = first.log_softmax(-1)[runner_up].item()
    assert got["meta_info"]["output_token_logprobs"][0][0] == pytest.approx(raw, abs=1e-4)
    with pytest.raises(InvalidRequest) as e:
        engine.generate(prompt, params | {"logit_bias": {str(model.config.vocab_size): 1.0}})
    assert e.value.param == "logit_bias"
