"""The models the frontend can serve (from the cluster view) and their tokenizers, loaded
once per model on first use."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shared.clients import ViewWatcher
from shared.errors import NotFound, Unavailable
from shared.logging import get_logger
from shared.messages.cluster import ModelInfo
from shared.tokenization import ModelTokenizer

log = get_logger(__name__)


class ModelCatalog:
    def __init__(self, view: ViewWatcher) -> None:
        self._view = view
        self._tokenizers: dict[str, ModelTokenizer] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def models(self) -> list[ModelInfo]:
        return list(self._view.view.models)

    def get(self, model: str) -> ModelInfo:
        if self._view.view.version < 0:
            # No view yet: say "not now", not "no such model".
            raise Unavailable(
                "The cluster view is not available yet; retry shortly.",
                retry_after_s=1,
                code="starting",
            )
        for m in self._view.view.models:
            if m.id == model:
                return m
        raise NotFound(
            f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )

    async def tokenizer(self, info: ModelInfo) -> ModelTokenizer:
        tok = self._tokenizers.get(info.path)
        if tok is not None:
            return tok
        lock = self._locks.setdefault(info.path, asyncio.Lock())
        async with lock:
            if info.path not in self._tokenizers:
                try:
                    self._tokenizers[info.path] = await asyncio.to_thread(
                        ModelTokenizer.from_dir, Path(info.path)
                    )
                except OSError as e:
                    # The cluster manager lists the model, but this frontend cannot read its
                    # files: a deployment that did not give it the models directory.
                    log.error("tokenizer unreadable", model=info.id, error=str(e))
                    raise Unavailable(
                        f"The model `{info.id}` is listed but this frontend cannot read its "
                        f"tokenizer ({e}): is the models directory mounted on every frontend?",
                        code="model_unavailable",
                    ) from e
        return self._tokenizers[info.path]
