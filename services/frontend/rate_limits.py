"""Per-tenant limits, enforced atomically in Redis and shared by every frontend.

Admission is one Lua script (``ADMIT``): it refills the tenant's request and token buckets,
drops expired leases from its in-flight set, decides, and takes what the request needs, all
or nothing. Redis runs a script alone, so 100 concurrent requests against a budget of 10
admit exactly 10, wherever they arrive. The clock is Redis's own (``TIME``), so frontends
whose clocks differ agree.

- requests/min and tokens/min are token buckets that refill continuously (a full minute's
  budget at most). Admission takes one request and the prompt's tokens.
- Generated tokens are charged as they stream (``Lease.charge``, every ``CHARGE_EVERY``
  tokens), not when the request ends: a stream that runs the budget out ends there, so one
  long request cannot overshoot it by more than a batch.
- Concurrent requests are members of a sorted set scored by a lease expiry that the
  frontend renews while the request runs; a frontend that dies frees its slots when the
  leases run out.

If Redis cannot be reached, a request is admitted unlimited (and counted): limits must not
take serving down with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from typing import Any

import msgspec
from prometheus_client import Counter
from redis.exceptions import RedisError

from shared.errors import BadRequest, RateLimited
from shared.logging import get_logger
from shared.messages.api import SamplingParams
from shared.store import Store
from shared.subjects import Keys
from shared.tenancy import EffectiveLimits

log = get_logger(__name__)

CHARGE_EVERY = 16  # generated tokens charged in one call
BUCKET_TTL_MS = 120_000  # an idle tenant's bucket state expires (it would be full again)

REFUSED = Counter(
    "meshserve_rate_limited", "Requests refused by a tenant's limits", ["tenant", "limit"]
)
UNENFORCED = Counter(
    "meshserve_limits_unenforced", "Requests admitted without their limits (Redis unreachable)"
)

_REFILL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local s = redis.call('HMGET', KEYS[1], 'req', 'tok', 'at')
local dt = math.max(0, now - (tonumber(s[3]) or now))
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local req = tonumber(s[1]) or rpm
local tok = tonumber(s[2]) or tpm
if rpm > 0 then req = math.min(rpm, req + dt * rpm / 60000) end
if tpm > 0 then tok = math.min(tpm, tok + dt * tpm / 60000) end
"""

_SAVE = f"""
redis.call('HSET', KEYS[1], 'req', tostring(req), 'tok', tostring(tok), 'at', now)
redis.call('PEXPIRE', KEYS[1], {BUCKET_TTL_MS})
"""

# KEYS: rate hash, in-flight set. ARGV: rpm, tpm, concurrent, prompt tokens, request id,
# lease ms. Returns {admitted, wait ms for requests, tokens, concurrency, requests left,
# tokens left, in flight}.
ADMIT = (
    _REFILL
    + """
local conc, need, rid, lease = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local inflight = 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  inflight = redis.call('ZCARD', KEYS[2])
end
local wreq, wtok, wconc = 0, 0, 0
if rpm > 0 and req < 1 then wreq = math.ceil((1 - req) * 60000 / rpm) end
if tpm > 0 and tok < need then wtok = math.ceil((need - tok) * 60000 / tpm) end
if conc > 0 and inflight >= conc then wconc = 1000 end
local ok = 0
if wreq == 0 and wtok == 0 and wconc == 0 then
  ok = 1
  if rpm > 0 then req = req - 1 end
  if tpm > 0 then tok = tok - need end
  if conc > 0 then
    redis.call('ZADD', KEYS[2], now + lease, rid)
    redis.call('PEXPIRE', KEYS[2], 2 * lease)
    inflight = inflight + 1
  end
end
"""
    + _SAVE
    + """
return {ok, wreq, wtok, wconc, tostring(req), tostring(tok), inflight}
"""
)

# KEYS: rate hash. ARGV: rpm, tpm, tokens generated. Returns the tokens left.
CHARGE = (
    _REFILL
    + """
tok = tok - tonumber(ARGV[3])
"""
    + _SAVE
    + """
return tostring(tok)
"""
)

# KEYS: in-flight set. ARGV: lease ms, request ids. Extends the leases of those still held.
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[1]))
return 0
"""


def check_sizes(
    limits: EffectiveLimits,
    req: Any,
    sampling: SamplingParams,
    *,
    prompt_tokens: int,
    param: str,
) -> SamplingParams:
    """The tenant's size limits on one request: a prompt over ``max_prompt_tokens`` or a
    ``max_tokens`` over ``max_output_tokens`` is a 400; a request that sets no output limit
    gets the tenant's."""
    if limits.max_prompt_tokens and prompt_tokens > limits.max_prompt_tokens:
        raise BadRequest(
            f"Your {param} resulted in {prompt_tokens} tokens, more than the "
            f"{limits.max_prompt_tokens} your limit allows. Please reduce the length of the "
            f"{param}.",
            param=param,
            code="prompt_too_long",
        )
    cap = limits.max_output_tokens
    if not cap or sampling.max_tokens <= cap:
        return sampling
    if req.max_output_tokens is not None:
        raise BadRequest(
            f"max_tokens is {req.max_output_tokens}, more than the {cap} your limit allows.",
            param="max_tokens",
            code="max_tokens_too_large",
        )
    return msgspec.structs.replace(sampling, max_tokens=cap)


def reset_text(ms: float) -> str:
    """A wait the way OpenAI's ``x-ratelimit-reset-*`` headers write it: 20ms, 1.5s, 6m0s."""
    if ms < 1000:
        return f"{max(0, math.ceil(ms))}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.3g}s"
    return f"{int(s // 60)}m{int(s % 60)}s"


@dataclasses.dataclass
class LimitCheck:
    admitted: bool
    wait_ms: dict[str, int]  # limit -> ms until it would admit this request (0: it would)
    requests_left: float
    tokens_left: float
    in_flight: int

    def headers(self, limits: EffectiveLimits) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the limits the tenant has."""
        out: dict[str, str] = {}
        if rpm := limits.requests_per_minute:
            out["x-ratelimit-limit-requests"] = str(rpm)
            out["x-ratelimit-remaining-requests"] = str(max(0, math.floor(self.requests_left)))
            out["x-ratelimit-reset-requests"] = reset_text((rpm - self.requests_left) * 6e4 / rpm)
        if tpm := limits.tokens_per_minute:
            out["x-ratelimit-limit-tokens"] = str(tpm)
            out["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(self.tokens_left)))
            out["x-ratelimit-reset-tokens"] = reset_text((tpm - self.tokens_left) * 6e4 / tpm)
        return out


class Lease:
    """An admitted request's hold on its tenant's budget: charges its generated tokens and
    gives its concurrency slot back."""

    def __init__(
        self, limiter: Limiter | None, tenant: str, rid: str, limits: EffectiveLimits
    ) -> None:
        self._limiter, self.tenant, self.rid, self.limits = limiter, tenant, rid, limits
        self.headers: dict[str, str] = {}
        self.exhausted = False  # the token budget ran out while it streamed
        self._pending = 0

    async def charge(self, n: int) -> bool:
        """Charge ``n`` generated tokens; False once the tenant's token budget is spent."""
        if self._limiter is None or not self.limits.tokens_per_minute:
            return True
        self._pending += n
        if self._pending >= CHARGE_EVERY:
            await self._flush()
        return not self.exhausted

    async def _flush(self) -> None:
        assert self._limiter is not None
        n, self._pending = self._pending, 0
        if n:
            left = await self._limiter.charge(self.tenant, self.limits, n)
            self.exhausted = left is not None and left <= 0

    async def release(self) -> None:
        if self._limiter is None:
            return
        if self.limits.tokens_per_minute:
            await self._flush()
        if self.limits.concurrent_requests:
            await self._limiter.release(self.tenant, self.rid)


class Limiter:
    def __init__(self, store: Store | None, cluster: str, lease_s: float) -> None:
        self._store = store
        self._keys = Keys(cluster)
        self._lease_ms = int(lease_s * 1000)
        self._scripts: dict[str, Any] = {}
        if store is not None:
            r = store.redis
            self._scripts = {
                "admit": r.register_script(ADMIT),
                "charge": r.register_script(CHARGE),
                "renew": r.register_script(RENEW),
            }
        self._held: dict[str, set[str]] = {}  # tenant -> request ids holding a slot here

    async def admit(
        self, tenant: str, limits: EffectiveLimits, rid: str, prompt_tokens: int
    ) -> Lease:
        """Take the request's share of the tenant's limits, or raise RateLimited (429)."""
        if not limits.rated or self._store is None:
            return Lease(None, tenant, rid, limits)
        if limits.tokens_per_minute and prompt_tokens > limits.tokens_per_minute:
            raise BadRequest(
                f"Request too large: its prompt has {prompt_tokens} tokens, more than the "
                f"{limits.tokens_per_minute} tokens per minute your limit allows.",
                param="messages",
                code="request_too_large",
            )
        try:
            raw = await self._scripts["admit"](
                keys=[self._keys.rate(tenant), self._keys.in_flight(tenant)],
                args=[
                    limits.requests_per_minute,
                    limits.tokens_per_minute,
                    limits.concurrent_requests,
                    prompt_tokens,
                    rid,
                    self._lease_ms,
                ],
            )
        except (RedisError, OSError) as e:
            log.warning("limits not enforced: redis unreachable", tenant=tenant, error=str(e))
            UNENFORCED.inc()
            return Lease(None, tenant, rid, limits)
        ok, wreq, wtok, wconc, req_left, tok_left, in_flight = raw
        decision = LimitCheck(
            admitted=bool(ok),
            wait_ms={"requests": int(wreq), "tokens": int(wtok), "concurrency": int(wconc)},
            requests_left=float(req_left),
            tokens_left=float(tok_left),
            in_flight=int(in_flight),
        )
        headers = decision.headers(limits)
        if not decision.admitted:
            raise self._refusal(tenant, limits, decision, headers)
        lease = Lease(self, tenant, rid, limits)
        lease.headers = headers
        if limits.concurrent_requests:
            self._held.setdefault(tenant, set()).add(rid)
        return lease

    @staticmethod
    def _refusal(
        tenant: str, limits: EffectiveLimits, d: LimitCheck, headers: dict[str, str]
    ) -> RateLimited:
        which = max(d.wait_ms, key=lambda k: d.wait_ms[k])
        REFUSED.labels(tenant, which).inc()
        what = {
            "requests": f"requests per minute (limit {limits.requests_per_minute})",
            "tokens": f"tokens per minute (limit {limits.tokens_per_minute}, "
            f"{max(0, math.floor(d.tokens_left))} left)",
            "concurrency": f"concurrent requests (limit {limits.concurrent_requests})",
        }[which]
        err = RateLimited(
            f"Rate limit reached for tenant {tenant} on {what}. Please try again in "
            f"{reset_text(d.wait_ms[which])}.",
            retry_after_s=d.wait_ms[which] / 1000,
            code="rate_limit_exceeded",
        )
        err.headers = headers
        return err

    async def charge(self, tenant: str, limits: EffectiveLimits, n: int) -> float | None:
        """Tokens left in the tenant's budget after charging ``n`` (None: not counted)."""
        try:
            left = await self._scripts["charge"](
                keys=[self._keys.rate(tenant)],
                args=[limits.requests_per_minute, limits.tokens_per_minute, n],
            )
        except (RedisError, OSError) as e:
            log.warning("tokens not charged: redis unreachable", tenant=tenant, error=str(e))
            return None
        return float(left)

    async def release(self, tenant: str, rid: str) -> None:
        held = self._held.get(tenant)
        if held is not None:
            held.discard(rid)
            if not held:
                del self._held[tenant]
        assert self._store is not None
        try:
            await self._store.redis.zrem(self._keys.in_flight(tenant), rid)
        except (RedisError, OSError) as e:  # its lease runs out instead
            log.warning("concurrency slot not freed", tenant=tenant, error=str(e))

    async def renew_forever(self) -> None:
        """Keep the leases of this frontend's requests alive (every third of a lease)."""
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            for tenant, rids in list(self._held.items()):
                with contextlib.suppress(RedisError, OSError):
                    await self._scripts["renew"](
                        keys=[self._keys.in_flight(tenant)], args=[self._lease_ms, *rids]
                    )
