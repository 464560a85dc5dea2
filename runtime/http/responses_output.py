"""A reply's output items, built from the chat reader's deltas (`runtime.http.chat_reply.ChatReply`), with the
stream events that announce them in the order the `openai` client's stream reader expects: an item is added,
then its content part, then the deltas, then the part and the item are done. One item is open at a time:
reasoning (K3's thinking, as `reasoning_text` content), a message (`output_text`) or a function call; a delta of
another kind closes it. A whole (non-streamed) reply is pushed as one delta, so both give the same items."""

from __future__ import annotations

import uuid
from typing import Any

from runtime.http.openai_protocol import DeltaMessage
from runtime.http.responses_protocol import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputTextPart,
    ReasoningPart,
    seal_reasoning,
)

Event = dict[str, Any]  # without its sequence number, which the route numbers


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self, seal_reasoning: bool = False) -> None:
        self.seal_reasoning = seal_reasoning  # reasoning items carry their text sealed too (`encrypted_content`)
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._calls: dict[int, OutputFunctionCall] = {}  # by the reader's call index

    def push(self, delta: DeltaMessage) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning_content:
            events += self._reasoning(delta.reasoning_content)
        if delta.content:
            events += self._text(delta.content)
        for call in delta.tool_calls or []:
            events += self._call(call.index, call.id, call.function.name, call.function.arguments or "")
        return events

    def finish(self, complete: bool) -> list[Event]:
        """Close the open item: "incomplete" when the reply was cut short (max_output_tokens)."""
        return self._close("completed" if complete else "incomplete")

    # --- items ---

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self._open, OutputReasoning):
            events += self._close("completed")
            item = OutputReasoning(id=_item_id("rs"))
            events += self._add(item)
            item.content.append(ReasoningPart())
            events.append(self._part_event("response.content_part.added", item, ReasoningPart()))
        item = self._open
        assert isinstance(item, OutputReasoning)
        item.content[0].text += text
        events.append({"type": "response.reasoning_text.delta", "item_id": item.id, "output_index": self._index(),
                       "content_index": 0, "delta": text})
        return events

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self._open, OutputMessage):
            events += self._close("completed")
            item = OutputMessage(id=_item_id("msg"))
            events += self._add(item)
            item.content.append(OutputTextPart())
            events.append(self._part_event("response.content_part.added", item, OutputTextPart()))
        item = self._open
        assert isinstance(item, OutputMessage)
        item.content[0].text += text
        events.append({"type": "response.output_text.delta", "item_id": item.id, "output_index": self._index(),
                       "content_index": 0, "delta": text, "logprobs": []})
        return events

    def _call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[Event]:
        events: list[Event] = []
        if index not in self._calls:  # its first delta carries its id and name
            events += self._close("completed")
            item = OutputFunctionCall(id=_item_id("fc"), call_id=call_id or _item_id("call"), name=name or "")
            self._calls[index] = item
            events += self._add(item)
        item = self._calls[index]
        if arguments:
            item.arguments += arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": item.id,
                           "output_index": self._index(), "delta": arguments})
        return events

    # --- events ---

    def _index(self) -> int:
        return len(self.items) - 1

    def _add(self, item: OutputItem) -> list[Event]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": self._index(), "item": item.model_dump()}]

    def _part_event(self, kind: str, item: OutputMessage | OutputReasoning, part: Any) -> Event:
        return {"type": kind, "item_id": item.id, "output_index": self._index(), "content_index": 0,
                "part": part.model_dump()}

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status  # type: ignore[assignment]
        index = self.items.index(item)
        events: list[Event] = []
        if isinstance(item, OutputReasoning):
            part = item.content[0]
            if self.seal_reasoning:
                item.encrypted_content = seal_reasoning(part.text)
            events += [{"type": "response.reasoning_text.done", "item_id": item.id, "output_index": index,
                        "content_index": 0, "text": part.text},
                       {"type": "response.content_part.done", "item_id": item.id, "output_index": index,
                        "content_index": 0, "part": part.model_dump()}]
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            events += [{"type": "response.output_text.done", "item_id": item.id, "output_index": index,
                        "content_index": 0, "text": part.text, "logprobs": []},
                       {"type": "response.content_part.done", "item_id": item.id, "output_index": index,
                        "content_index": 0, "part": part.model_dump()}]
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item.id, "output_index": index,
                           "name": item.name, "arguments": item.arguments})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item.model_dump()})
        return events
