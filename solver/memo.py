"""Results the solver reuses across searches, keyed partly by object identity.

One solve searches the same cluster several times (the main search, the node-drop seed, a seeded
re-search), and a what-if sweep or a goodput simulation solves many clusters that share a profile,
stage tables and node classes. Profiles and stage tables hold lists, so they cannot be hashed by
value; an entry here is keyed by their identities instead and keeps them alive, so no identity is
reused by another object while its entry exists.
"""

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Value = TypeVar("Value")


class IdentityMemo(Generic[Value]):
    """A bounded memo: `get(objects, key, build)` returns build() once per (identities of objects, key).

    When full it forgets everything (the entries of one sweep are all alike; no need for LRU order).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._entries: dict[tuple, tuple[tuple, Value]] = {}

    def peek(self, objects: tuple, key: Hashable) -> Value | None:
        """The value of (identities of objects, key) if it was built, else None (builds nothing)."""
        hit = self._entries.get((tuple(id(o) for o in objects), key))
        return None if hit is None else hit[1]

    def get(self, objects: tuple, key: Hashable, build: Callable[[], Value]) -> Value:
        full = (tuple(id(o) for o in objects), key)
        hit = self._entries.get(full)
        if hit is not None:
            return hit[1]
        value = build()
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._entries[full] = (objects, value)
        return value
