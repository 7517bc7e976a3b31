"""The Responses API's store (--enable-response-store): stored responses, by id, in the HTTP process's
memory, for `GET /v1/responses/{id}`, its input items, and `previous_response_id`.

Upstream's store has no bound; this one holds at most --response-store-max-mb: each response is kept as
its JSON bytes (the response, its input items, and the items of the conversation a next turn continues),
so the bound is the memory it takes, and the least recently used finished response goes first. A
background response still queued or running is never dropped (its task writes its end into it); when
those fill the store, a new one is refused. Like OpenAI's, a response is readable by whoever has its id
(a random 128-bit id): there is no per-client namespace beyond the API key.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

RUNNING = ("queued", "in_progress")


@dataclass
class StoredResponse:
    """A stored response, as JSON bytes."""

    response_json: bytes  # the Response object as it is served
    items_json: bytes  # the request's input items, each with an id
    # The items a next turn continues from: the previous turns', this input's and this output's
    # (instructions excluded: OpenAI does not carry them over to the next turn).
    conversation_json: bytes
    rid: str
    status: str

    @classmethod
    def of(cls, response: dict, items: list[dict[str, Any]], conversation: list[dict[str, Any]]) -> StoredResponse:
        return cls(orjson.dumps(response), orjson.dumps(items), orjson.dumps(conversation), response["id"],
                   response["status"])  # fmt: skip

    @property
    def size(self) -> int:
        # A queued response reserves the room its "in_progress" takes (replaced in place, unchecked).
        reserve = len("in_progress") - len("queued") if self.status == "queued" else 0
        return len(self.response_json) + len(self.items_json) + len(self.conversation_json) + reserve

    def response(self) -> dict[str, Any]:
        return orjson.loads(self.response_json)

    def input_items(self) -> list[dict[str, Any]]:
        return orjson.loads(self.items_json)

    def conversation(self) -> list[dict[str, Any]]:
        return orjson.loads(self.conversation_json)


class ResponseStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used = 0
        self.running = 0  # the bytes of queued or running background responses (never dropped)
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Store (or replace) a response, dropping the least recently used finished ones to make room;
        False (nothing stored, nothing dropped) if running background responses leave too little."""
        old = self._entries.get(entry.rid)
        pinned = self.running - (old.size if old is not None and old.status in RUNNING else 0)
        if pinned + entry.size > self.max_bytes:
            return False
        self.delete(entry.rid)
        while self.used + entry.size > self.max_bytes:  # (the finished ones suffice: checked above)
            victim = next(e for e in self._entries.values() if e.status not in RUNNING)
            self.delete(victim.rid)
        self._entries[entry.rid] = entry
        self.used += entry.size
        self.running += entry.size if entry.status in RUNNING else 0
        return True

    def replace(self, entry: StoredResponse, stub: StoredResponse | None = None) -> bool:
        """A stored response's new state (a background response moving on): only if it is still stored
        (a deleted one stays deleted). A running response's next state always lands: running to running
        in place (a queued one reserved the room), running to finished as `put`, else
        `stub` (a small failed response: the finished one does not fit) in its place."""
        old = self._entries.get(entry.rid)
        if old is None:
            return False
        if old.status in RUNNING and entry.status in RUNNING:
            self.delete(entry.rid)
            self._entries[entry.rid] = entry
            self.used += entry.size
            self.running += entry.size
            return True
        if self.put(entry):
            return True
        if old.status in RUNNING:
            self.delete(entry.rid)
            return stub is not None and self.put(stub)
        return False

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
        self.running -= entry.size if entry.status in RUNNING else 0
        return True
