"""The wire format of the messages between the processes (`runtime/messages.py`)."""

from __future__ import annotations

from runtime.messages import TokenOut, TokenOuts, decode, encode


def test_a_steps_token_outs_travel_as_one_message() -> None:
    outs = [
        TokenOut("a", [5, 6], logprobs=[-0.5, -1.25], top_logprobs=[[(5, -0.5)], [(6, -1.25), (7, -2.0)]]),
        TokenOut("b", [9], finished="stop", matched_stop=9, prompt_tokens=12, cached_tokens=8),
        TokenOut("c", [], finished="error", error="the grammar refused", invalid=True, error_param="response_format"),
    ]
    frames = encode(TokenOuts(outs))
    assert len(frames) == 1
    got = decode(frames)
    assert isinstance(got, TokenOuts) and all(isinstance(o, TokenOut) for o in got.outs)
    assert [o.rid for o in got.outs] == ["a", "b", "c"]
    assert got.outs[0].token_ids == [5, 6] and got.outs[0].logprobs == [-0.5, -1.25]
    # (id, logprob) pairs come back as JSON pairs, as a lone TokenOut's do
    assert got.outs[0].top_logprobs == decode(encode(outs[0])).top_logprobs == [[[5, -0.5]], [[6, -1.25], [7, -2.0]]]
    assert (got.outs[1].finished, got.outs[1].matched_stop, got.outs[1].prompt_tokens, got.outs[1].cached_tokens) == (
        "stop", 9, 12, 8)
    assert (got.outs[2].error, got.outs[2].invalid, got.outs[2].error_param) == (
        "the grammar refused", True, "response_format")
    assert decode(encode(TokenOuts([]))).outs == []
