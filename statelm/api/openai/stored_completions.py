"""Chat completions made with `store: true`: kept in memory per owner, the oldest dropped past a bound."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from statelm.api.errors import APIError
from statelm.api.protocol import StoredChatCompletion
from statelm.sessions.ownership import Principal


@dataclass(frozen=True)
class StoredEntry:
    """A stored completion and the owner (API key) that made it."""

    owner: str
    completion: StoredChatCompletion


class CompletionStore:
    """The last `capacity` stored completions of every owner together, by id; lost when the server stops."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredEntry] = OrderedDict()

    def check_enabled(self) -> None:
        """400 naming `store` when this server keeps no completions."""
        if self.capacity <= 0:
            raise APIError(
                "this server keeps no completions (started with --max-stored-completions 0); send store: false",
                param="store",
            )

    def put(self, owner: str, completion: StoredChatCompletion) -> None:
        """Keep completion for owner, dropping the oldest stored completion past the capacity."""
        self._entries[completion.id] = StoredEntry(owner, completion)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, principal: Principal, completion_id: str) -> StoredChatCompletion:
        """The stored completion, if principal may see it; 404 otherwise (another key's looks like none)."""
        entry = self._entries.get(completion_id)
        if entry is None or not principal.may_access(entry.owner):
            raise APIError(
                f"No stored chat completion found with id '{completion_id}'.",
                status=404,
                type="not_found_error",
                param="completion_id",
                code="completion_not_found",
            )
        return entry.completion

    def delete(self, principal: Principal, completion_id: str) -> None:
        """Forget a stored completion principal may see; 404 otherwise."""
        self.get(principal, completion_id)
        del self._entries[completion_id]
