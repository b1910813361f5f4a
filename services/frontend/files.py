"""OpenAI's Files API, for fine-tuning data (``shared.file_store``): the official client's
``files.create/list/retrieve/content/delete`` work unchanged.

    POST   /v1/files                 multipart: purpose, file   -> the file
    GET    /v1/files[?purpose&limit&order&after]                 -> {"object": "list", ...}
    GET    /v1/files/{file_id}                                   -> the file
    GET    /v1/files/{file_id}/content                           -> its bytes
    DELETE /v1/files/{file_id}                                   -> {"id", "deleted": true}

A tenant sees its own files only (another tenant's is the same 404 as a missing one); the
admin sees all. Needs Redis: without it each route answers 503."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from services.frontend.auth import Principal, principal_of
from shared.errors import BadRequest, NotFound, Unavailable
from shared.file_store import CHUNK, FileObject, FileStore
from shared.fine_tuning import page

MAX_LIST = 10_000
FILES_PATH = "/v1/files"  # also where the auth middleware allows an upload's size


class FilesAPI:
    def __init__(self, files: FileStore | None) -> None:
        self._files = files

    @property
    def store(self) -> FileStore | None:
        return self._files

    def routes(self, app: web.Application) -> None:
        app.router.add_post(FILES_PATH, self.create)
        app.router.add_get(FILES_PATH, self.list)
        app.router.add_get(FILES_PATH + "/{file_id}", self.retrieve)
        app.router.add_get(FILES_PATH + "/{file_id}/content", self.content)
        app.router.add_delete(FILES_PATH + "/{file_id}", self.delete)

    def _store(self) -> FileStore:
        if self._files is None:
            raise Unavailable("Files need the cluster's Redis (MESHSERVE_REDIS_URL).")
        return self._files

    async def _owned(self, request: web.Request) -> FileObject:
        file_id = request.match_info["file_id"]
        obj = await self._store().get(file_id)
        if obj is None:
            raise NotFound(f"No such file: {file_id}.", code="file_not_found")
        return principal_of(request).check_owner(obj, obj.tenant, "file", file_id)

    async def create(self, request: web.Request) -> web.Response:
        files = self._store()
        principal = principal_of(request)
        if not request.content_type.startswith("multipart/"):
            raise BadRequest("Upload files as multipart/form-data with `purpose` and `file`.")
        try:
            obj = await self._upload(request, files, principal)
        except (ValueError, AssertionError, LookupError, HttpProcessingError) as e:
            # aiohttp's multipart reader on a malformed body (a bad boundary, headers or
            # encoding): the client's fault
            raise BadRequest(f"The multipart body could not be read: {e}.") from e
        return web.json_response(obj.openai())

    @staticmethod
    async def _upload(request: web.Request, files: FileStore, principal: Principal) -> FileObject:
        reader = await request.multipart()
        purpose: str | None = None
        obj: FileObject | None = None
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise BadRequest("Nested multipart bodies are not accepted.")
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                if purpose is None:
                    raise BadRequest(
                        "`purpose` must come before `file` in the form.", param="purpose"
                    )
                if obj is not None:
                    raise BadRequest("One `file` per upload.", param="file")
                obj = await files.create(
                    tenant=principal.tenant,
                    purpose=purpose,
                    filename=part.filename or "",
                    chunks=_chunks(part),
                )
            else:
                await part.release()
        if obj is None:
            raise BadRequest("The form has no `file`.", param="file")
        return obj

    async def list(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        q = request.query
        try:
            limit = min(int(q.get("limit", MAX_LIST)), MAX_LIST)
        except ValueError as e:
            raise BadRequest("`limit` must be an integer.", param="limit") from e
        if limit < 1:
            raise BadRequest("`limit` must be at least 1.", param="limit")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest("`order` must be `asc` or `desc`.", param="order")
        objs = [o for o in await self._store().list() if principal.owns(o.tenant)]
        if purpose := q.get("purpose"):
            objs = [o for o in objs if o.purpose == purpose]
        if order == "asc":
            objs.reverse()
        chunk, more = page(objs, after=q.get("after"), limit=limit)
        body: dict[str, Any] = {
            "object": "list",
            "data": [o.openai() for o in chunk],
            "has_more": more,
            "first_id": chunk[0].id if chunk else None,
            "last_id": chunk[-1].id if chunk else None,
        }
        return web.json_response(body)

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response((await self._owned(request)).openai())

    async def content(self, request: web.Request) -> web.FileResponse:
        obj = await self._owned(request)
        path = self._store().path(obj.id)
        if not path.is_file():
            raise NotFound(f"The bytes of file {obj.id} are gone.", code="file_not_found")
        return web.FileResponse(
            path,
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Disposition": f'attachment; filename="{obj.filename}"',
            },
        )

    async def delete(self, request: web.Request) -> web.Response:
        obj = await self._owned(request)
        await self._store().delete(obj)
        return web.json_response({"id": obj.id, "object": "file", "deleted": True})


async def _chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(CHUNK):
        yield chunk
