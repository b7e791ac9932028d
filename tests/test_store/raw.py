"""Raw access to a tiered store's tiers, for tests that bypass the store API."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kvstore.abc.store import Backend, ReadView
from kvstore.store import open_backend


class TieredRaw:
    """Every tier's backend: writes go to all of them, reads to the fastest."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self.backends = list(backends)

    @classmethod
    def open(cls, url: str) -> TieredRaw:
        tiers = dict(parse_qsl(urlsplit(url).query))["tiers"].split(",")
        return cls([open_backend(t) for t in tiers])

    def reader(self) -> AbstractContextManager[ReadView]:
        return self.backends[0].reader()

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.backends[0].get_many(keys)

    def put_many(self, items: Iterable[tuple[bytes, Any]], **kw: Any) -> int:
        items = list(items)
        return [b.put_many(items, **kw) for b in self.backends][0]

    def delete_many(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)
        return [b.delete_many(keys) for b in self.backends][0]

    def close(self) -> None:
        for b in self.backends:
            b.close()
