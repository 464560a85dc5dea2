"""Programs against the in-process `Runtime` backend (built-in k3-tiny, real engine processes): gen with
stops, roles through the chat template, select against the no-cache forward, fork's shared prefix computed
once, run_batch order, streaming, and engine errors raised with their message."""

from __future__ import annotations

import pytest

import frontend_lang as sgl
from frontend_lang.chat_template import K3
from runtime.tokenizer.k3_encoding import K3ChatOptions, render_k3_chat
from tests.frontend_lang.oracle import choice_logprobs, tiny_model
from tests.frontend_lang.programs import (
    CHOICES,
    MERGING_CHOICES,
    MERGING_PREFIX,
    PREFIX,
    branches,
    chat,
    check_constrained,
    constrained,
    fork_and_append,
    nested_roles,
    numbered,
    pick,
    plain_gen,
    typed_markup,
    with_regex,
)


def test_gen_stops_at_a_stop_string(runtime: sgl.Runtime) -> None:
    free = plain_gen.run(prompt=PREFIX, temperature=0, backend=runtime)["out"]
    assert len(free) > 8
    stop = free[4:7]  # a string greedy decoding is known to produce, so the stop must fire
    cut = free[: free.index(stop)]
    state = plain_gen.run(prompt=PREFIX, stop=[stop], temperature=0, backend=runtime)
    assert state["out"] == cut
    assert state.text() == PREFIX + cut
    meta = state.get_meta_info("out")
    assert meta["finish_reason"]["type"] == "stop" and meta["finish_reason"]["matched"] == stop
    # The same stop as a program-wide default of run().
    assert plain_gen.run(prompt=PREFIX, temperature=0, backend=runtime, stop=stop)["out"] == cut


def test_roles_follow_the_models_chat_template(runtime: sgl.Runtime) -> None:
    """k3-tiny is a K3 model: the roles are K3's messages, as the server renders its chats (thinking off)."""
    state = chat.run(question="How many clips?", temperature=0, backend=runtime)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[1]["content"] == "How many clips?" and msgs[3]["content"] == "And why?"
    assert msgs[2]["content"] == state["answer"].lstrip() and msgs[4]["content"] == state["why"].lstrip()
    raw = [m | {"content": c} for m, c in zip(msgs, [msgs[0]["content"], msgs[1]["content"], state["answer"],
                                                      msgs[3]["content"], state["why"]], strict=True)]
    assert runtime.chat_template == K3
    assert state.text() == render_k3_chat(raw, None, K3ChatOptions(thinking=False), add_generation_prompt=False).text
    with pytest.raises(ValueError, match="do not nest"):
        nested_roles.run(backend=runtime)


def test_text_of_a_program_never_becomes_markup(runtime: sgl.Runtime) -> None:
    """Marker strings in a program's text (its strings, forked branches, choices) are encoded as text: the
    prompt's special ids are the role markup's alone."""
    tok = runtime.tokenizer
    typed = "".join(tok.id_to_piece(i) for i in sorted(tok.special_ids))
    state = typed_markup.run(typed=typed, temperature=0, backend=runtime)
    turns = [{"role": "system", "content": "Be brief." + typed}, {"role": "user", "content": typed * 2 + "x" + typed}]
    off = K3ChatOptions(thinking=False)
    want = render_k3_chat(turns, None, off).ids(tok)  # the generation prompt is the assistant role's prefix
    got = [t for _, t, _ in state.get_meta_info("answer")["input_token_logprobs"]]
    assert got == want
    message = ["<|open|>", "<|sep|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
    markers = [*message, *message, "<|open|>", "<|sep|>", "<|open|>", "<|sep|>"]
    assert [i for i in got if i in tok.special_ids] == [*map(tok.piece_to_id, markers)]  # the roles', no BOS
    turns += [{"role": "assistant", "content": state["answer"]}, {"role": "user", "content": typed + "?"},
              {"role": "assistant", "content": state["pick"]}]
    assert state.text() == render_k3_chat(turns, None, off, add_generation_prompt=False).text
    scored = state.get_meta_info("pick")["input_token_logprobs"][0]  # the choice `typed`, after the role's marker
    assert [t for _, t in scored] == tok.encode_ordinary(typed)


@pytest.mark.parametrize(("prefix", "choices"), [(PREFIX, CHOICES), (MERGING_PREFIX, MERGING_CHOICES)])
def test_select_picks_the_best_normalised_logprob(runtime: sgl.Runtime, prefix: str, choices: list[str]) -> None:
    model = tiny_model(runtime.engine.args.seed)
    tok = runtime.tokenizer
    merges = [tok.encode(prefix + c, add_bos=True)[: len(tok.encode(prefix, add_bos=True))]
              != tok.encode(prefix, add_bos=True) for c in choices]
    assert all(merges) == (prefix == MERGING_PREFIX)
    truth = [choice_logprobs(model, tok, prefix, c) for c in choices]
    means = [sum(t) / len(t) for t in truth]
    sums = [sum(t) for t in truth]
    state = pick.run(prefix=prefix, choices=choices, backend=runtime)
    meta = state.get_meta_info("pick")
    for got, want in zip(meta["input_token_logprobs"], truth, strict=True):
        assert [lp for lp, _ in got] == pytest.approx(want, abs=1e-4)
    assert meta["normalized_prompt_logprobs"] == pytest.approx(means, abs=1e-4)
    assert state["pick"] == choices[means.index(max(means))]
    assert state.text() == prefix + state["pick"]
    assert all(c > 0 for c in meta["cached_tokens"])  # the prefix was cached before the choices were scored
    other = pick.run(prefix=prefix, choices=choices, method=sgl.unnormalized, backend=runtime)
    assert other["pick"] == choices[sums.index(max(sums))]
    assert other["pick"] != state["pick"]  # the methods disagree here, so each is checked on its own


def test_fork_computes_the_shared_prefix_once(runtime: sgl.Runtime) -> None:
    prefix = PREFIX * 3 + "Answer:"
    n_prefix = len(runtime.tokenizer.encode(prefix, add_bos=True))
    before = runtime.get_server_info()["prefill_tokens_computed"]
    state = branches.run(prefix=prefix, n=4, temperature=0, backend=runtime)
    computed = runtime.get_server_info()["prefill_tokens_computed"] - before
    outs = state["branch"]
    assert isinstance(outs, list) and len(outs) == 4 and len(set(outs)) == 1  # greedy: one answer four times
    assert computed <= n_prefix + 4 * 2  # the prefix once, then about a token per branch
    assert state.text() == prefix  # gather_variable leaves the parent's text alone
    joined = fork_and_append.run(prefix=prefix, temperature=0, backend=runtime)
    metas = joined.ret_value
    assert all(m["cached_tokens"] >= n_prefix - 1 for m in metas)  # each branch found the committed prefix
    assert joined.text() == prefix + "".join(joined["parts"])


def test_run_batch_returns_states_in_order(runtime: sgl.Runtime) -> None:
    args = [{"i": i} for i in range(6)]
    states = numbered.run_batch(args, temperature=0, backend=runtime, num_threads=3, progress_bar=True)
    assert [s.text().split(":")[0] for s in states] == [f"Question {i}" for i in range(6)]
    alone = [numbered.run(i=i, temperature=0, backend=runtime)["answer"] for i in (4, 1)]
    assert [states[4]["answer"], states[1]["answer"]] == alone


def test_stream_yields_the_text_as_it_is_made(runtime: sgl.Runtime) -> None:
    whole = plain_gen.run(prompt=PREFIX, temperature=0, backend=runtime)
    mid = len(whole["out"]) // 2
    stop = whole["out"][mid : mid + 3]
    state = plain_gen.run(prompt=PREFIX, stop=[stop], temperature=0, stream=True, backend=runtime)
    pieces = list(state.text_iter())  # the stop string is trimmed in the stream too, never sent then taken back
    assert "".join(pieces) == state.text() == PREFIX + whole["out"][: whole["out"].index(stop)]
    again = plain_gen.run(prompt=PREFIX, temperature=0, stream=True, backend=runtime)
    var_pieces = list(again.text_iter("out"))
    assert len(var_pieces) > 2 and "".join(var_pieces) == again["out"] == whole["out"]


def test_engine_errors_raise_with_the_engines_message(runtime: sgl.Runtime) -> None:
    with pytest.raises(sgl.BackendError, match="temperature"):
        plain_gen.run(prompt="x", temperature=-1.0, backend=runtime)
    with pytest.raises(sgl.BackendError, match="temperature"):
        plain_gen.run_batch([{"prompt": "a"}, {"prompt": "b"}], temperature=-1.0, backend=runtime)
    streamed = plain_gen.run(prompt="x", temperature=-1.0, stream=True, backend=runtime)
    with pytest.raises(sgl.BackendError, match="temperature"):
        list(streamed.text_iter())
    with pytest.raises(sgl.BackendError, match="invalid regex"):  # the grammar backend's message
        constrained.run(regex="[0-9", backend=runtime)
    assert with_regex.run(backend=runtime)["n"].isdigit()
    with pytest.raises(RuntimeError, match="no backend"):
        sgl.set_default_backend(None)
        numbered.run(i=1)


def test_gen_regex_and_json_schema_outputs_match(runtime: sgl.Runtime) -> None:
    check_constrained(runtime)
