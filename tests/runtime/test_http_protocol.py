"""The server's pure parts, without a server: request models and their mapping to sampling parameters, error
messages, and the metrics a request's chunks produce."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from runtime.http.api_errors import validation_error
from runtime.http.metrics import ServerMetrics
from runtime.http.native_api import GenerateRequest
from runtime.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from runtime.http.sse import event

MSG = [{"role": "user", "content": "hi"}]


def test_openai_fields_map_to_sampling_params() -> None:
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "max_completion_tokens": 7,
                                                 "stop": "x", "temperature": 0, "top_k": 5, "min_tokens": 2})
    assert chat.sampling(chat.max_new_tokens) == {"n": 1, "temperature": 0.0, "top_k": 5, "min_new_tokens": 2,
                                                  "max_new_tokens": 7, "stop": ["x"]}
    content = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert content.messages[0].text() == "ab" and content.sampling(None) == {"n": 1}
    comp = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]]})
    assert comp.prompts() == [[1, 2], [3]] and comp.max_tokens == 16
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "p"}).prompts() == ["p"]


def test_native_shapes() -> None:
    batch = GenerateRequest.model_validate({"input_ids": [[1], [2, 3]], "sampling_params": [{}, {"n": 2}]})
    assert batch.is_batch and batch.prompts() == [[1], [2, 3]] and batch.per_prompt("rid", 2) == [None, None]
    single = GenerateRequest.model_validate({"input_ids": [1, 2]})
    assert not single.is_batch and single.prompts() == [[1, 2]]


@pytest.mark.parametrize(("model", "body", "message"), [
    (ChatCompletionRequest, {"model": "m", "messages": MSG, "n": "2"}, "n: Input should be a valid integer"),
    (ChatCompletionRequest, {"model": "m", "messages": MSG, "temperature": 2.5e400}, "temperature: "),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "function", "content": "x"}]}, "messages[0].role: "),
    (ChatCompletionRequest, {"messages": MSG, "n": "2", "extra": 1}, "(and 1 more bad field(s))"),
    (GenerateRequest, {"text": []}, "text: no accepted form matches: Input should be a valid string; or List"),
    (GenerateRequest, {"text": "a", "wat": 1}, "wat: unknown field"),
])
def test_validation_messages_name_the_field(model: type, body: dict, message: str) -> None:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    err = validation_error(e.value)
    assert err.status == 400 and message in err.message and err.param is not None


def test_request_timer_metrics() -> None:
    m = ServerMetrics()
    t = m.timer()
    t.chunk(0, 1)
    t.chunk(0, 3)
    t.chunk(1, 1)
    t.finish("length", 10)
    t.finish("stop", 10)
    text = m.render({"running": 2, "prompt_tokens": 8, "cached_tokens": 2, "state_hits": 1}).decode()
    samples = {s.name + str(sorted(s.labels.items())): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples["radixk3_generation_tokens_total[]"] == 5
    assert samples["radixk3_time_to_first_token_seconds_count[]"] == 2  # one per sample
    assert samples["radixk3_inter_token_latency_seconds_count[]"] == 3  # the 3 tokens after sample 0's first
    assert samples["radixk3_e2e_request_latency_seconds_count[]"] == 2
    assert samples["radixk3_prompt_tokens_total[]"] == 20
    assert samples["radixk3_requests_total[('finish_reason', 'length')]"] == 1
    assert samples["radixk3_num_running_reqs[]"] == 2 and samples["radixk3_cache_hit_rate[]"] == 0.25
    assert samples["radixk3_state_checkpoint_hits_total[]"] == 1
    assert samples["radixk3_admitted_prompt_tokens_total[]"] == 8
    assert samples["radixk3_cached_prompt_tokens_total[]"] == 2


def test_sse_events_escape_unicode_line_breaks() -> None:
    """JSON leaves U+2028, U+2029 and U+0085 raw; line-splitting clients (str.splitlines, httpx's iter_lines)
    would cut the event there. Escaped, the event is one line, and the same object to a JSON parser."""
    obj = {"text": "a\u2028b\u2029c\x85d\ne\x0bf\x1cg", "ids": [1, 2], "nested": [["\u2028", None]]}
    frame = event(obj)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    line, blank = frame.decode().splitlines()  # the event's line, and the empty one that ends it
    assert blank == ""
    assert orjson.loads(line.removeprefix("data: ")) == obj
    assert b"\\u2028" in frame and b"\\u2029" in frame and b"\\u0085" in frame


def test_reasoning_options() -> None:
    """SGLang's separate_reasoning=false puts the reasoning back into the content; stream_reasoning=false holds
    it back until the last chunk."""
    from radixk3.tokenizer import load_tokenizer
    from runtime.http.chat_reply import ChatReply, whole_reply
    from runtime.tokenizer.k3_reply import ReplyAssembler
    from runtime.tokenizer.k3_tools import THINK_PREFIX

    tok = load_tokenizer()
    chunks = ["Let me ", "see.<|close|>think<|sep|><|open|>response<|sep|>", "Four."]

    def deltas(**options: bool) -> list[tuple[str | None, str | None]]:
        reply = ChatReply(ReplyAssembler(THINK_PREFIX, tools=False), tok, **options)
        out = [reply.push(c, "length" if k == len(chunks) - 1 else None, []) for k, c in enumerate(chunks)]
        return [(d.content, d.reasoning_content) for d in out]

    assert deltas() == [(None, "Let me "), (None, "see."), ("Four.", None)]
    assert deltas(stream_reasoning=False) == [(None, None), (None, None), ("Four.", "Let me see.")]
    assert deltas(separate_reasoning=False) == [("Let me ", None), ("see.", None), ("Four.", None)]
    for separate, want in ((True, ("Four.", "Let me see.")), (False, ("Let me see.Four.", None))):
        message, _ = whole_reply(ReplyAssembler(THINK_PREFIX, tools=False), tok, "".join(chunks), "length", [],
                                 separate_reasoning=separate)
        assert (message.content, message.reasoning_content) == want
