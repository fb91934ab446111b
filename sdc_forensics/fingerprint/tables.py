"""One cache for the fingerprint paths' constant tables (numpy on the host, torch on a device).

Each path (``core``'s torch code, ``cpu_kernel``, ``triton_kernel``) keeps its own instance, so
the keys never mix; the two rules live here once: a fixed table is made once per key, and a
prefix-stable one (``c_j``, ``beta``) is grown to the next power of two (at least 1,024 rows)
and sliced, so a longer tensor never changes the rows a shorter one used.
"""

from __future__ import annotations

import threading


class TableCache:
    """Thread-safe ``key -> table`` store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[tuple, object] = {}

    def get(self, key: tuple, make):
        """The table for ``key``, made by ``make()`` the first time."""
        with self._lock:
            value = self._tables.get(key)
            if value is None:
                value = make()
                self._tables[key] = value
            return value

    def prefix(self, key: tuple, rows: int, make):
        """The first ``rows`` rows of a prefix-stable table, ``make(n)`` building ``n`` rows."""
        with self._lock:
            table = self._tables.get(key)
            if table is None or table.shape[0] < rows:
                table = make(1 << max(10, (rows - 1).bit_length()))
                self._tables[key] = table
        return table[:rows]

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
