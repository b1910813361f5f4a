"""Tenants and their API keys, kept in Redis.

A key is ``sk-ms-`` and 43 random URL-safe characters (256 bits). Redis holds only its
SHA-256: with that much entropy a fast hash is as safe as a slow one, and a lookup is one
HGET. A key record names its tenant; a tenant record says which models the tenant may use
(``None``: all) and its limits (unset fields take the cluster's ``limits`` settings).

Keys (``shared.subjects.Keys``): ``auth:keys`` (hash: SHA-256 hex -> ``ApiKey`` JSON),
``auth:key_ids`` (hash: key id -> SHA-256 hex), ``tenants`` (hash: name -> ``Tenant``
JSON). Creating a key for a tenant that has no record creates the record with defaults.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import time
from pathlib import Path

import msgspec

from shared.errors import BadRequest
from shared.files import write_file
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Keys

KEY_PREFIX = "sk-ms-"
TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_TENANT = "default"  # who everyone is with auth off


class Limits(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A tenant's own limits; ``None`` takes the cluster's setting, 0 is no limit."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_body_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None and not 0 <= value < 2**53:
                raise ValueError(f"{name} must be a non-negative integer")


class Tenant(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    name: str
    models: list[str] | None = None  # the models it may use; None: every model
    limits: Limits = msgspec.field(default_factory=Limits)
    created: int = 0

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


class ApiKey(msgspec.Struct, omit_defaults=True):
    """What is stored about a key: never the key itself."""

    id: str
    tenant: str
    name: str = ""
    created: int = 0
    hint: str = ""  # its last four characters, to tell keys apart in a list


class EffectiveLimits(msgspec.Struct, frozen=True):
    """A tenant's limits with the cluster's defaults filled in; 0 is no limit."""

    requests_per_minute: int
    tokens_per_minute: int
    concurrent_requests: int
    max_prompt_tokens: int
    max_output_tokens: int
    max_body_bytes: int

    @property
    def rated(self) -> bool:
        """Whether admission has anything to count in Redis."""
        return bool(self.requests_per_minute or self.tokens_per_minute or self.concurrent_requests)


def effective_limits(tenant: Tenant, settings: Settings) -> EffectiveLimits:
    own, base = tenant.limits, settings.limits
    body = settings.frontend.max_body_bytes

    def pick(value: int | None, default: int) -> int:
        return default if value is None else value

    return EffectiveLimits(
        requests_per_minute=pick(own.requests_per_minute, base.requests_per_minute),
        tokens_per_minute=pick(own.tokens_per_minute, base.tokens_per_minute),
        concurrent_requests=pick(own.concurrent_requests, base.concurrent_requests),
        max_prompt_tokens=pick(own.max_prompt_tokens, base.max_prompt_tokens),
        max_output_tokens=pick(own.max_output_tokens, base.max_output_tokens),
        # A tenant's body limit only narrows the frontend's own.
        max_body_bytes=min(body, own.max_body_bytes or body),
    )


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def same_secret(a: str, b: str) -> bool:
    return hmac.compare_digest(hash_key(a), hash_key(b))


def check_tenant_name(name: str) -> str:
    if not TENANT_NAME.match(name):
        raise BadRequest(
            "A tenant name is 1 to 64 letters, digits, '_', '.' or '-'.", param="tenant"
        )
    return name


def loopback_only(host: str) -> bool:
    """Whether a listener on ``host`` is reachable from this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or "" (every interface)
        return False


def auth_on(settings: Settings) -> bool:
    """Whether the frontend asks for keys: ``MESHSERVE_AUTH``, where ``auto`` is on wherever
    the frontend listens beyond loopback."""
    if settings.auth.mode == "auto":
        return not loopback_only(settings.frontend.http_host)
    return settings.auth.mode == "on"


def default_admin_key_file(settings: Settings) -> Path:
    return Path.home() / ".cache" / "meshserve" / f"{settings.cluster}.admin-key"


def admin_key(settings: Settings) -> str | None:
    """The admin key: the setting, else the file (``admin_key_file`` or its default)."""
    if settings.auth.admin_key is not None:
        return settings.auth.admin_key.get_secret_value()
    return read_admin_key(settings.auth.admin_key_file or default_admin_key_file(settings))


def read_admin_key(path: Path) -> str | None:
    """The admin key in ``path``; None where it is missing, unreadable or empty."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def write_admin_key(path: Path, *, owner: int | None = None) -> str:
    """Make a new admin key and write it where only this user (or ``owner``) can read it."""
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    write_file(path, secret + "\n", owner=owner)
    return secret


_key_decoder = msgspec.json.Decoder(ApiKey)
_tenant_decoder = msgspec.json.Decoder(Tenant)


class TenantStore:
    def __init__(self, store: Store, cluster: str) -> None:
        self._redis = store.redis
        self._keys = Keys(cluster)

    # -- keys ----------------------------------------------------------------------------

    async def create_key(self, tenant: str, name: str = "") -> tuple[ApiKey, str]:
        """A new key of ``tenant``: its record and the secret, shown once."""
        check_tenant_name(tenant)
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        digest = hash_key(secret)
        record = ApiKey(
            id="key_" + secrets.token_hex(8),
            tenant=tenant,
            name=name,
            created=int(time.time()),
            hint=secret[-4:],
        )
        async with self._redis.pipeline(transaction=True) as p:
            p.hsetnx(
                self._keys.tenants(),
                tenant,
                msgspec.json.encode(Tenant(name=tenant, created=record.created)),
            )
            p.hset(self._keys.api_keys(), digest, msgspec.json.encode(record))
            p.hset(self._keys.api_key_ids(), record.id, digest)
            await p.execute()
        return record, secret

    async def lookup(self, secret: str) -> ApiKey | None:
        raw = await self._redis.hget(self._keys.api_keys(), hash_key(secret))
        return None if raw is None else _key_decoder.decode(raw)

    async def list_keys(self, tenant: str | None = None) -> list[ApiKey]:
        raw = await self._redis.hvals(self._keys.api_keys())
        keys = [_key_decoder.decode(v) for v in raw]
        return sorted(
            (k for k in keys if tenant is None or k.tenant == tenant),
            key=lambda k: (k.tenant, k.created, k.id),
        )

    async def revoke(self, key_id: str) -> tuple[ApiKey, str] | None:
        """Delete a key; its record and its hash (for caches to drop), or None."""
        digest = await self._redis.hget(self._keys.api_key_ids(), key_id)
        if digest is None:
            return None
        digest_s = digest.decode() if isinstance(digest, bytes) else digest
        async with self._redis.pipeline(transaction=True) as p:
            p.hget(self._keys.api_keys(), digest_s)
            p.hdel(self._keys.api_keys(), digest_s)
            p.hdel(self._keys.api_key_ids(), key_id)
            raw, _, _ = await p.execute()
        return None if raw is None else (_key_decoder.decode(raw), digest_s)

    # -- tenants -------------------------------------------------------------------------

    async def tenant(self, name: str) -> Tenant | None:
        raw = await self._redis.hget(self._keys.tenants(), name)
        return None if raw is None else _tenant_decoder.decode(raw)

    async def tenants(self) -> list[Tenant]:
        raw = await self._redis.hvals(self._keys.tenants())
        return sorted((_tenant_decoder.decode(v) for v in raw), key=lambda t: t.name)

    async def put_tenant(self, tenant: Tenant) -> Tenant:
        check_tenant_name(tenant.name)
        if not tenant.created:
            tenant = msgspec.structs.replace(tenant, created=int(time.time()))
        await self._redis.hset(self._keys.tenants(), tenant.name, msgspec.json.encode(tenant))
        return tenant
