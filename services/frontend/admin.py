"""The admin HTTP API: API keys and tenants. Every route needs the admin (the admin key;
anyone with auth off). ``meshserve keys`` and ``meshserve tenants`` call it.

    POST   /admin/keys            {"tenant": T, "name": N}  -> 201 the key, shown once
    GET    /admin/keys[?tenant=T]                           -> {"data": [keys]}
    DELETE /admin/keys/{id}                                 -> {"id", "deleted": true}
    GET    /admin/tenants                                   -> {"data": [tenants]}
    GET    /admin/tenants/{name}                            -> the tenant
    PUT    /admin/tenants/{name}  {"models": [...]|null, "limits": {...}} -> the tenant
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from services.frontend.auth import Authenticator, principal_of
from shared.bus import Bus
from shared.errors import BadRequest, NotFound, Unavailable
from shared.messages.auth import KeyRevoked
from shared.subjects import Subjects
from shared.tenancy import Limits, Tenant, TenantStore, check_tenant_name


class NewKey(msgspec.Struct, forbid_unknown_fields=True):
    tenant: str
    name: str = ""


class TenantUpdate(msgspec.Struct, forbid_unknown_fields=True):
    models: list[str] | None = None
    limits: Limits = msgspec.field(default_factory=Limits)


def _decode(body: bytes, into: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body or b"{}", type=into)
    except (msgspec.DecodeError, ValueError) as e:
        raise BadRequest(f"Invalid request body: {e}") from e


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )


class AdminAPI:
    def __init__(
        self, tenants: TenantStore | None, auth: Authenticator, bus: Bus, subjects: Subjects
    ) -> None:
        self._tenants = tenants
        self._auth = auth
        self._bus = bus
        self._subjects = subjects

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/admin/keys", self.create_key)
        app.router.add_get("/admin/keys", self.list_keys)
        app.router.add_delete("/admin/keys/{id}", self.revoke_key)
        app.router.add_get("/admin/tenants", self.list_tenants)
        app.router.add_get("/admin/tenants/{name}", self.get_tenant)
        app.router.add_put("/admin/tenants/{name}", self.put_tenant)

    def _store(self, request: web.Request) -> TenantStore:
        principal_of(request).require_admin()
        if self._tenants is None:
            raise Unavailable("Tenants need Redis (MESHSERVE_REDIS_URL).")
        return self._tenants

    async def create_key(self, request: web.Request) -> web.Response:
        store = self._store(request)
        req: NewKey = _decode(await request.read(), NewKey)
        record, secret = await store.create_key(req.tenant, req.name)
        return _json({**msgspec.to_builtins(record), "key": secret}, status=201)

    async def list_keys(self, request: web.Request) -> web.Response:
        store = self._store(request)
        keys = await store.list_keys(request.query.get("tenant"))
        return _json({"object": "list", "data": keys})

    async def revoke_key(self, request: web.Request) -> web.Response:
        store = self._store(request)
        key_id = request.match_info["id"]
        revoked = await store.revoke(key_id)
        if revoked is None:
            raise NotFound(f"No such API key: {key_id}.", code="key_not_found")
        record, digest = revoked
        await self._bus.publish(self._subjects.key_revoked(), KeyRevoked(key_hash=digest))
        await self._auth.on_key_revoked(KeyRevoked(key_hash=digest))
        return _json({"id": record.id, "object": "api_key.deleted", "deleted": True})

    async def list_tenants(self, request: web.Request) -> web.Response:
        store = self._store(request)
        return _json({"object": "list", "data": await store.tenants()})

    async def get_tenant(self, request: web.Request) -> web.Response:
        store = self._store(request)
        name = request.match_info["name"]
        tenant = await store.tenant(name)
        if tenant is None:
            raise NotFound(f"No such tenant: {name}.", code="tenant_not_found")
        return _json(tenant)

    async def put_tenant(self, request: web.Request) -> web.Response:
        store = self._store(request)
        name = check_tenant_name(request.match_info["name"])
        update: TenantUpdate = _decode(await request.read(), TenantUpdate)
        old = await store.tenant(name)
        tenant = await store.put_tenant(
            Tenant(
                name=name,
                models=update.models,
                limits=update.limits,
                created=old.created if old is not None else 0,
            )
        )
        self._auth.forget_tenant(name)
        return _json(tenant)
