"""Tenants, keys and limits against a real Redis: the admission script decides atomically
however many requests race for a budget, tokens are charged as they stream, concurrency
slots come back on release or when their lease runs out."""

from __future__ import annotations

import asyncio

import pytest

from services.frontend.rate_limits import Limiter, reset_text
from shared.errors import BadRequest, RateLimited
from shared.tenancy import EffectiveLimits, Limits, Tenant, TenantStore

pytestmark = pytest.mark.redis


def limits(**kw: int) -> EffectiveLimits:
    base = dict(
        requests_per_minute=0,
        tokens_per_minute=0,
        concurrent_requests=0,
        max_prompt_tokens=0,
        max_output_tokens=0,
        max_body_bytes=1 << 20,
    )
    return EffectiveLimits(**{**base, **kw})


async def _race(limiter: Limiter, lim: EffectiveLimits, n: int, prompt: int = 1) -> list:
    async def one(i: int):
        try:
            return await limiter.admit("acme", lim, f"r{i}", prompt)
        except RateLimited as e:
            return e

    return await asyncio.gather(*(one(i) for i in range(n)))


async def test_a_hundred_concurrent_requests_against_ten_per_minute_admit_exactly_ten(
    store, cluster
):
    limiter = Limiter(store, cluster, lease_s=30)
    got = await _race(limiter, limits(requests_per_minute=10), 100)
    admitted = [g for g in got if not isinstance(g, RateLimited)]
    refused = [g for g in got if isinstance(g, RateLimited)]
    assert len(admitted) == 10 and len(refused) == 90
    err = refused[0]
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert 0 < err.retry_after_s <= 6.1  # one request refills in 60 s / 10
    assert err.headers["x-ratelimit-limit-requests"] == "10"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert "requests per minute" in err.message


async def test_token_budget_is_shared_by_concurrent_requests(store, cluster):
    limiter = Limiter(store, cluster, lease_s=30)
    # 1000 tokens a minute, prompts of 100: exactly ten fit, whatever the interleaving.
    got = await _race(limiter, limits(tokens_per_minute=1000), 40, prompt=100)
    assert sum(not isinstance(g, RateLimited) for g in got) == 10
    with pytest.raises(BadRequest, match="Request too large"):
        await limiter.admit("acme", limits(tokens_per_minute=1000), "big", 1001)


async def test_generated_tokens_are_charged_while_they_stream(store, cluster):
    limiter = Limiter(store, cluster, lease_s=30)
    lim = limits(tokens_per_minute=100)
    lease = await limiter.admit("acme", lim, "r1", 20)
    assert lease.headers["x-ratelimit-remaining-tokens"] == "80"
    # 16 tokens at a time reach Redis before the request ends: another request sees them.
    for _ in range(4):
        assert await lease.charge(4)
    other = await limiter.admit("acme", lim, "r2", 1)
    assert int(other.headers["x-ratelimit-remaining-tokens"]) in (63, 64)  # refill: < 1 token
    # The budget runs out mid-stream: charge says stop, and the lease says why.
    within = [await lease.charge(4) for _ in range(20)]
    assert within[-1] is False and lease.exhausted
    assert within.index(False) <= 16  # stopped within one batch of the budget's end
    await lease.release()
    with pytest.raises(RateLimited, match="tokens per minute"):
        await limiter.admit("acme", lim, "r3", 10)


async def test_concurrency_slots_are_released_and_leases_expire(store, cluster):
    limiter = Limiter(store, cluster, lease_s=30)
    lim = limits(concurrent_requests=2)
    a = await limiter.admit("acme", lim, "a", 1)
    await limiter.admit("acme", lim, "b", 1)
    with pytest.raises(RateLimited, match="concurrent requests"):
        await limiter.admit("acme", lim, "c", 1)
    await a.release()
    await limiter.admit("acme", lim, "c", 1)
    # A frontend that died never releases: its slots come back when the lease runs out.
    dead = Limiter(store, cluster, lease_s=0.3)
    other = limits(concurrent_requests=1)
    await dead.admit("globex", other, "x", 1)
    with pytest.raises(RateLimited):
        await limiter.admit("globex", other, "y", 1)
    await asyncio.sleep(0.4)
    await limiter.admit("globex", other, "y", 1)


async def test_renewed_leases_outlive_their_first_term(store, cluster):
    limiter = Limiter(store, cluster, lease_s=0.3)
    lim = limits(concurrent_requests=1)
    await limiter.admit("acme", lim, "long", 1)
    renew = asyncio.create_task(limiter.renew_forever())
    try:
        await asyncio.sleep(0.8)
        with pytest.raises(RateLimited):
            await limiter.admit("acme", lim, "next", 1)
    finally:
        renew.cancel()


async def test_no_limits_touch_no_redis(cluster):
    limiter = Limiter(None, cluster, lease_s=30)
    lease = await limiter.admit("acme", limits(requests_per_minute=1), "r", 1)
    assert await lease.charge(10**6) and not lease.headers


async def test_keys_are_stored_hashed_and_revoked(store, cluster):
    tenants = TenantStore(store, cluster)
    record, secret = await tenants.create_key("acme", "ci")
    assert secret.startswith("sk-ms-") and len(secret) > 40
    raw = b"".join(v for v in (await store.redis.hgetall(f"{cluster}:auth:keys")).values())
    assert secret.encode() not in raw and secret[-4:] == record.hint
    assert (await tenants.lookup(secret)).tenant == "acme"
    assert await tenants.lookup(secret + "x") is None
    assert (await tenants.tenant("acme")).models is None  # created with defaults
    await tenants.create_key("globex")
    assert [k.tenant for k in await tenants.list_keys()] == ["acme", "globex"]
    assert [k.id for k in await tenants.list_keys("acme")] == [record.id]
    revoked, _ = await tenants.revoke(record.id)
    assert revoked.id == record.id
    assert await tenants.lookup(secret) is None and await tenants.revoke(record.id) is None
    await tenants.put_tenant(Tenant(name="acme", models=["m"], limits=Limits(max_prompt_tokens=9)))
    got = await tenants.tenant("acme")
    assert got.models == ["m"] and got.limits.max_prompt_tokens == 9


def test_reset_text_reads_like_openais():
    assert [reset_text(ms) for ms in (20.2, 1500, 6000, 360_000, 61_500)] == [
        "21ms",
        "1.5s",
        "6s",
        "6m0s",
        "1m1s",
    ]
