"""The Responses API's store (--enable-response-store): stored responses, by id, in the HTTP process's
memory, for `GET /v1/responses/{id}`, its input items, and `previous_response_id`.

Upstream's store has no bound; this one holds at most --response-store-max-mb of JSON (a response, its
input items, and the conversation a next turn continues, counted as their JSON sizes) and drops the least
recently used response first. A response larger than the whole bound is not kept. Like OpenAI's, a response
is readable by whoever has its id (a random 128-bit id): there is no per-client namespace beyond the API key.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as it is served
    input_items: list[dict[str, Any]]  # the request's input items, each with an id
    # The chat messages a next turn continues from: the previous turns', this input's and this output's
    # (instructions excluded: OpenAI does not carry them over to the next turn).
    conversation: list[dict[str, Any]]
    size: int = 0


class ResponseStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Store (or replace) a response; False if it is larger than the whole store."""
        rid = entry.response["id"]
        self.delete(rid)
        entry.size = sum(len(orjson.dumps(x)) for x in (entry.response, entry.input_items, entry.conversation))
        if entry.size > self.max_bytes:
            return False
        while self.used + entry.size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.used -= old.size
        self._entries[rid] = entry
        self.used += entry.size
        return True

    def update(self, response: dict[str, Any], conversation: list[dict[str, Any]] | None = None) -> None:
        """A stored response's new state (a background response that finished); nothing if it is gone."""
        entry = self._entries.get(response["id"])
        if entry is not None:
            self.put(StoredResponse(response, entry.input_items, conversation or entry.conversation))

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self.used -= entry.size
        return True
