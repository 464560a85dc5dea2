"""The server's memory of stored responses (`store: true`, the API's default), for `previous_response_id` and
`GET /v1/responses/{id}`: in this process only, bounded by count and by characters; the oldest go first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

MAX_RESPONSES = 1024
MAX_CHARS = 64 << 20  # of the stored responses and conversations, as JSON


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was served
    conversation: tuple[dict[str, Any], ...]  # its chat messages up to its reply, instructions left out
    chars: int


def stored(body: dict[str, Any], conversation: list[dict[str, Any]]) -> StoredResponse:
    chars = len(orjson.dumps(body)) + len(orjson.dumps(conversation))
    return StoredResponse(body, tuple(conversation), chars)


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self.max_responses = max_responses
        self.max_chars = max_chars

    def put(self, rid: str, item: StoredResponse) -> None:
        """Keep `item` under `rid`; one larger than the whole store is not kept."""
        self.delete(rid)
        if item.chars > self.max_chars:
            return
        self._items[rid] = item
        self._chars += item.chars
        while len(self._items) > self.max_responses or self._chars > self.max_chars:
            _, old = self._items.popitem(last=False)
            self._chars -= old.chars

    def get(self, rid: str) -> StoredResponse | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)  # in use: a conversation going on stays
        return item

    def delete(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is None:
            return False
        self._chars -= item.chars
        return True

    def __len__(self) -> int:
        return len(self._items)
