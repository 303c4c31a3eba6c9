"""Stored responses (`store: true`): what `previous_response_id` continues and `GET` returns,
kept in memory and evicted least recently used first when they exceed their byte budget."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from mlxgate._native import ErrorKind
from mlxgate.api.errors import ApiError


@dataclass(frozen=True)
class StoredResponse:
    response: bytes  # the Response object, as the client got it
    # This request's input items and the id it continued; instructions are not carried over.
    input: list[dict[str, Any]]
    previous_id: str | None

    @property
    def nbytes(self) -> int:
        return len(self.response) + len(orjson.dumps(self.input))


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        ErrorKind.NOT_FOUND,
        f"Response with id '{response_id}' not found.",
        param=param,
        should_retry=False,
    )


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        size = entry.nbytes
        if size > self.max_bytes:
            return
        self.delete(response_id)
        self._entries[response_id] = (entry, size)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.nbytes -= evicted

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        found = self._entries.get(response_id)
        if found is None:
            raise not_found(response_id, param)
        self._entries.move_to_end(response_id)
        return found[0]

    def delete(self, response_id: str) -> bool:
        found = self._entries.pop(response_id, None)
        if found is not None:
            self.nbytes -= found[1]
        return found is not None

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation up to and including `response_id`: every stored input and output
        item of it and the responses it continued, oldest first."""
        chain = []
        next_id: str | None = response_id
        while next_id is not None:
            entry = self.get(next_id, param="previous_response_id")
            chain.append(entry)
            next_id = entry.previous_id
        items: list[dict[str, Any]] = []
        for entry in reversed(chain):
            items.extend(entry.input)
            items.extend(orjson.loads(entry.response).get("output") or [])
        return items
