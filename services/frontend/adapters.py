"""Fine-tuned models as the frontend serves them: each is a LoRA adapter of a base model
(``shared.fine_tuning.Adapter``, registered in Redis when its job succeeds), visible to its
own tenant only. A request naming one runs on its base model's TEs under the adapter.

The registry is read through a short cache (``TTL_S``): a new adapter answers within that,
and a request does not cost a Redis round trip."""

from __future__ import annotations

import time

from shared.errors import NotFound
from shared.fine_tuning import Adapter, FineTuneStore

TTL_S = 1.0
PREFIX = "ft:"


def is_fine_tuned(model: str) -> bool:
    return model.startswith(PREFIX)


class AdapterCatalog:
    def __init__(self, store: FineTuneStore | None) -> None:
        self._store = store
        self._cached: dict[str, Adapter] = {}
        self._read_at = -TTL_S

    async def all(self) -> dict[str, Adapter]:
        if self._store is None:
            return {}
        if time.monotonic() - self._read_at >= TTL_S:
            self._cached = {a.name: a for a in await self._store.adapters()}
            self._read_at = time.monotonic()
        return self._cached

    async def get(self, name: str, tenant: str, *, admin: bool = False) -> Adapter:
        """The adapter ``name`` if the tenant owns it; the 404 of a missing model if not."""
        adapters = await self.all()
        adapter = adapters.get(name)
        if adapter is None and self._store is not None:  # registered since the last read
            adapter = await self._store.adapter(name)
        if adapter is None or not (admin or adapter.tenant == tenant):
            raise NotFound(
                f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        return adapter

    async def owned(self, tenant: str, *, admin: bool = False) -> list[Adapter]:
        return [a for a in (await self.all()).values() if admin or a.tenant == tenant]
