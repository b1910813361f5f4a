"""`meshserve keys` and `meshserve tenants`: the admin API (services/frontend/admin.py)
from a shell. They talk to a running frontend (``--url``, default this host's
``MESHSERVE_HTTP_PORT``) with the admin key (``MESHSERVE_ADMIN_KEY``, else the admin key
file `meshserve up` wrote), so they work the same against a laptop cluster and a remote one.

    meshserve keys create --tenant T [--name N]   prints the new key on stdout, only it
    meshserve keys list [--tenant T]
    meshserve keys revoke KEY_ID
    meshserve tenants list
    meshserve tenants set T [--models a,b | --all-models] [--requests-per-minute N] ...
    meshserve status [--watch SECONDS]            the cluster: models, node pools, TEs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

COMMANDS = ("keys", "tenants", "status")
LIMIT_FLAGS = (
    "requests_per_minute",
    "tokens_per_minute",
    "concurrent_requests",
    "max_prompt_tokens",
    "max_output_tokens",
    "max_body_bytes",
)


def add_commands(sub: Any) -> None:
    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    ks = keys.add_subparsers(dest="action", required=True)
    create = ks.add_parser("create", help="make a key for a tenant; prints it on stdout")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", default="", help="a label shown in lists")
    lst = ks.add_parser("list", help="list keys (never the keys themselves)")
    lst.add_argument("--tenant")
    revoke = ks.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    tenants = sub.add_parser("tenants", help="list tenants; set their models and limits")
    ts = tenants.add_subparsers(dest="action", required=True)
    ts.add_parser("list", help="every tenant with its models and limits")
    tset = ts.add_parser("set", help="set a tenant's models and limits (unset flags: defaults)")
    tset.add_argument("tenant")
    which = tset.add_mutually_exclusive_group()
    which.add_argument("--models", help="comma-separated model ids the tenant may use")
    which.add_argument("--all-models", action="store_true", help="every model (the default)")
    for flag in LIMIT_FLAGS:
        tset.add_argument(f"--{flag.replace('_', '-')}", type=int, metavar="N")
    status = sub.add_parser(
        "status",
        help="the cluster as tables: each model's readiness, the node pools and their TEs "
        "(GET /admin/status)",
    )
    status.add_argument(
        "--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C"
    )
    for p in (*ks.choices.values(), *ts.choices.values(), status):
        p.add_argument("--url", help="the frontend (default http://127.0.0.1:MESHSERVE_HTTP_PORT)")


def _call(base: str, key: str | None, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise SystemExit(f"meshserve: {method} {path}: {e.code}: {message}") from None
    except urllib.error.URLError as e:
        raise SystemExit(f"meshserve: cannot reach the frontend at {base}: {e.reason}") from None


def run(args: argparse.Namespace) -> int:
    from shared.settings import Settings
    from shared.tenancy import admin_key

    settings = Settings.load()
    base = (args.url or f"http://127.0.0.1:{settings.frontend.http_port}").rstrip("/")
    key = admin_key(settings)

    def call(method: str, path: str, body: Any = None) -> Any:
        return _call(base, key, method, path, body)

    if args.command == "status":
        return _status(lambda: call("GET", "/admin/status"), args.watch)
    if args.command == "keys" and args.action == "create":
        made = call("POST", "/admin/keys", {"tenant": args.tenant, "name": args.name})
        print(f"created {made['id']} for tenant {made['tenant']}", file=sys.stderr)
        print(made["key"])
    elif args.command == "keys" and args.action == "list":
        path = "/admin/keys" + (f"?tenant={args.tenant}" if args.tenant else "")
        rows: list[tuple[Any, ...]] = [
            (k["id"], k["tenant"], k.get("name", ""), f"…{k.get('hint', '')}")
            for k in call("GET", path)["data"]
        ]
        _table(("id", "tenant", "name", "ends"), rows)
    elif args.command == "keys" and args.action == "revoke":
        call("DELETE", f"/admin/keys/{args.key_id}")
        print(f"revoked {args.key_id}", file=sys.stderr)
    elif args.command == "tenants" and args.action == "list":
        rows = [
            (
                t["name"],
                ",".join(t["models"]) if t.get("models") is not None else "*",
                json.dumps(t.get("limits", {})),
            )
            for t in call("GET", "/admin/tenants")["data"]
        ]
        _table(("tenant", "models", "limits"), rows)
    elif args.command == "tenants" and args.action == "set":
        models = None if args.models is None else [m for m in args.models.split(",") if m]
        limits = {f: getattr(args, f) for f in LIMIT_FLAGS if getattr(args, f) is not None}
        got = call("PUT", f"/admin/tenants/{args.tenant}", {"models": models, "limits": limits})
        print(json.dumps(got))
    return 0


def status_tables(body: dict[str, Any]) -> None:
    """``GET /admin/status`` as tables: models, then each node pool's TEs."""
    print(
        f"cluster {body['cluster']} (view {body['version']}), "
        f"{len(body['job_executors'])} job executors, {len(body['frontends'])} frontends"
    )
    print()
    _table(
        ("model", "state", "ready", "loading"),
        [
            (m["id"], m["state"], m["ready_instances"], m["loading_instances"])
            for m in body["models"]
        ],
    )
    if traffic := body.get("traffic"):
        print("\ntraffic seen by this frontend (last 10 minutes)")

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1000:.0f}ms"

        _table(
            ("model", "req/s", "ttft p50", "ttft p95", "slo", "held"),
            [
                (
                    model,
                    f"{t['rate_per_s']:.2f}",
                    ms(t["ttft_p50_s"]),
                    ms(t["ttft_p95_s"]),
                    f"{t['slo_attainment']:.0%}",
                    t["held"],
                )
                for model, t in sorted(traffic.items())
            ],
        )
    for pool in body["pools"]:
        print(f"\npool {pool['id']} on {', '.join(pool['hosts'])}")
        _table(
            ("te", "state", "model", "role", "engine", "device", "running", "waiting", "kv"),
            [
                (
                    te["id"],
                    te["state"] + (f" ({te['training']})" if te["training"] else ""),
                    te["model"] or "-",
                    te["role"],
                    te["engine"] or "-",
                    te["device"] or "-",
                    te["running"],
                    te["waiting"],
                    "-" if te["kv_used"] is None else f"{te['kv_used']:.0%}",
                )
                for te in pool["tes"]
            ],
        )


def _events(body: dict[str, Any]) -> None:
    if events := body.get("scale_events"):
        print("\nrecent scale events")
        _table(
            ("kind", "model", "te", "ok", "seconds", "reason"),
            [
                (e["kind"], e["model"], e["te"], e["ok"], f"{e['total_s']:.2f}", e["reason"])
                for e in events[:5]
            ],
        )


def _status(fetch: Callable[[], Any], watch: float | None) -> int:
    try:
        while True:
            body = fetch()
            if watch:
                print("\033[2J\033[H", end="")  # clear the terminal, cursor home
            status_tables(body)
            _events(body)
            if not watch:
                return 0
            time.sleep(watch)
    except KeyboardInterrupt:
        return 0


def _table(head: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows, strict=False)]
    for row in (head, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
