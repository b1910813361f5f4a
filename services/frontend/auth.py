"""Who is calling: the API key in ``Authorization: Bearer`` resolved to a tenant.

With auth off (``MESHSERVE_AUTH=auto`` on loopback: the open local default; or ``off``,
said explicitly) every caller is the tenant ``default`` and may use the admin API. With it
on (``on``, or ``auto`` beyond loopback), a missing or unknown key is a 401; the admin key
(``shared.tenancy.admin_key``) is the admin, exempt from limits; any other key is looked up
by its hash in Redis and remembered for ``auth.key_cache`` (a revocation reaches every
frontend over NATS and drops it at once). A tenant's record (models, limits) is re-read at
most once a second. If Redis is unreachable, keys and records already known keep working.

An object a tenant owns is checked with ``Principal.check_owner``: another tenant's object
is ``NotFound`` (404), never a 403, so nobody learns that it exists.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TypeVar

from aiohttp import web
from redis.exceptions import RedisError

from shared.errors import Forbidden, NotFound, Unauthorized, Unavailable
from shared.logging import get_logger
from shared.messages.auth import KeyRevoked
from shared.settings import Settings
from shared.tenancy import (
    DEFAULT_TENANT,
    KEY_PREFIX,
    EffectiveLimits,
    Tenant,
    TenantStore,
    admin_key,
    auth_on,
    effective_limits,
    hash_key,
    loopback_only,
    same_secret,
)

log = get_logger(__name__)

ADMIN_TENANT = "admin"
TENANT_TTL_S = 1.0
MAX_CACHED_KEYS = 100_000

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Principal:
    tenant: str
    admin: bool
    tenant_record: Tenant
    limits: EffectiveLimits
    limited: bool = True  # the admin key is not

    def owns(self, owner_tenant: str) -> bool:
        return self.admin or owner_tenant == self.tenant

    def check_owner(self, obj: T, owner_tenant: str, what: str, name: str) -> T:
        """``obj`` if this caller may see it; otherwise the same 404 as a missing one."""
        if not self.owns(owner_tenant):
            raise NotFound(f"No such {what}: {name}.", code=f"{what}_not_found")
        return obj

    def may_use(self, model: str) -> bool:
        return not self.limited or self.tenant_record.may_use(model)

    def require_admin(self) -> None:
        if not self.admin:
            raise Forbidden("This endpoint needs the admin key.")


PRINCIPAL = web.RequestKey("principal", Principal)  # the middleware leaves it on the request


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def masked(secret: str) -> str:
    """How a wrong key is shown back: its start and its last four characters."""
    if len(secret) <= 12:
        return "*" * len(secret)
    return f"{secret[:6]}{'*' * 8}{secret[-4:]}"


class Authenticator:
    def __init__(self, settings: Settings, tenants: TenantStore | None) -> None:
        self._settings = settings
        self._tenants = tenants
        self.enabled = auth_on(settings)
        self._admin_key = admin_key(settings) if self.enabled else None
        host = settings.frontend.http_host
        if self.enabled and (self._admin_key is None or tenants is None):
            why = (
                "MESHSERVE_AUTH=on"
                if settings.auth.mode == "on"
                else f"Listening on {host or 'every interface'} (beyond loopback), auth is on"
            )
            raise SystemExit(
                f"{why}: it needs an admin key (MESHSERVE_ADMIN_KEY, or a file at "
                "MESHSERVE_ADMIN_KEY_FILE; `meshserve up` and compose.yaml generate one) and "
                "Redis (MESHSERVE_REDIS_URL). To serve open beyond loopback on purpose, set "
                "MESHSERVE_AUTH=off."
            )
        if not self.enabled and not loopback_only(host):
            log.warning(
                "auth is off (MESHSERVE_AUTH=off) on a frontend listening beyond loopback: "
                "anyone who reaches it may use every model and the admin API",
                host=host,
            )
        self._key_ttl = settings.auth.key_cache.total_seconds()
        self._keys: dict[str, tuple[str, float]] = {}  # key hash -> (tenant, checked at)
        self._records: dict[str, tuple[Tenant, float]] = {}  # tenant -> (record, read at)

    async def principal(self, request: web.Request) -> Principal:
        if not self.enabled:
            record = await self.tenant(DEFAULT_TENANT)
            return self._principal(DEFAULT_TENANT, record, admin=True)
        secret = bearer(request)
        if secret is None:
            raise Unauthorized(
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        assert self._admin_key is not None
        if same_secret(secret, self._admin_key):
            record = Tenant(name=ADMIN_TENANT)
            return Principal(
                ADMIN_TENANT,
                True,
                record,
                effective_limits(record, self._settings),
                limited=False,
            )
        tenant = await self._tenant_of(secret)
        return self._principal(tenant, await self.tenant(tenant), admin=False)

    def _principal(self, tenant: str, record: Tenant, *, admin: bool) -> Principal:
        return Principal(tenant, admin, record, effective_limits(record, self._settings))

    async def _tenant_of(self, secret: str) -> str:
        digest = hash_key(secret)
        now = time.monotonic()
        hit = self._keys.get(digest)
        if hit is not None and now - hit[1] < self._key_ttl:
            return hit[0]
        wrong = Unauthorized(f"Incorrect API key provided: {masked(secret)}.")
        if not secret.startswith(KEY_PREFIX):
            raise wrong
        assert self._tenants is not None
        try:
            key = await self._tenants.lookup(secret)
        except (RedisError, OSError) as e:
            if hit is not None:  # known a moment ago: Redis being away does not revoke it
                return hit[0]
            raise Unavailable(
                "API keys cannot be checked right now; retry shortly.", retry_after_s=1
            ) from e
        if key is None:
            self._keys.pop(digest, None)
            raise wrong
        if len(self._keys) >= MAX_CACHED_KEYS:
            self._keys.clear()
        self._keys[digest] = (key.tenant, now)
        return key.tenant

    async def tenant(self, name: str) -> Tenant:
        """The tenant's record (a default one if it has none), at most a second old."""
        now = time.monotonic()
        hit = self._records.get(name)
        if hit is not None and now - hit[1] < TENANT_TTL_S:
            return hit[0]
        if self._tenants is None:
            return Tenant(name=name)
        try:
            record = await self._tenants.tenant(name) or Tenant(name=name)
        except (RedisError, OSError) as e:
            if hit is None:
                log.warning("tenant record unreadable: defaults apply", tenant=name, error=str(e))
            return hit[0] if hit is not None else Tenant(name=name)
        self._records[name] = (record, now)
        return record

    def forget_tenant(self, name: str) -> None:
        self._records.pop(name, None)

    async def on_key_revoked(self, msg: KeyRevoked) -> None:
        self._keys.pop(msg.key_hash, None)


def principal_of(request: web.Request) -> Principal:
    return request[PRINCIPAL]
