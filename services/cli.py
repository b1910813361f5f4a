"""The `meshserve` command: `meshserve up` runs a local cluster; `meshserve <service>` runs
one service (what compose.yaml and a DaemonSet call)."""

from __future__ import annotations

import argparse
import runpy
import sys

SERVICE_NAMES = {
    "frontend": "services.frontend",
    "job-executor": "services.job_executor",
    "cluster-manager": "services.cluster_manager",
    "scaler": "services.scaler",
    "task-executor": "services.task_executor",
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="meshserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run a local cluster in the foreground (Ctrl-C stops it)")
    up.add_argument("--port", type=int, help="HTTP port of the API (MESHSERVE_HTTP_PORT)")
    up.add_argument("--models-dir", help="checkpoints directory (MESHSERVE_MODELS_DIR)")
    up.add_argument("--pool-size", type=int, help="pre-warmed TEs (MESHSERVE_POOL_SIZE)")
    up.add_argument("--cluster", help="cluster name (MESHSERVE_CLUSTER)")
    prof = sub.add_parser(
        "profile",
        help="measure a model's capacity on this host and engine now, offline, and store it "
        "with the model, so that no load measures it on its critical path",
    )
    prof.add_argument("model_dir", help="the checkpoint's directory")
    health = sub.add_parser(
        "health",
        help="exit 0 if the service in this container is alive (its MESHSERVE_HEALTH_FILE "
        "is fresh), or if --url answers /health with status ok; a container's health check",
    )
    health.add_argument("--url", help="a frontend's /health URL to ask instead of the file")
    sec = sub.add_parser(
        "infra-secrets",
        help="write per-role NATS and Redis credentials and the servers' configurations "
        "under DIR (compose.yaml's secrets service)",
    )
    sec.add_argument(
        "dir", help="where: DIR/nats and DIR/redis for the servers, DIR/<role> for each role"
    )
    sec.add_argument("--owner", type=int, help="uid (and gid) to own the roles' files")
    sec.add_argument(
        "--nats-host",
        default="nats",
        help="NATS's host in the roles' URLs; a NATS cluster's hosts, comma-separated, also "
        "route its servers to each other (nats.conf's cluster block)",
    )
    sec.add_argument(
        "--redis-host",
        default="redis",
        help="Redis's host in the roles' URLs; under Sentinel, the primary sentinel.conf watches",
    )
    sec.add_argument(
        "--redis-master",
        default="meshserve",
        help="the name the Sentinels watch the primary under (MESHSERVE_REDIS_MASTER)",
    )
    from services import admin_cli

    admin_cli.add_commands(sub)
    for name in SERVICE_NAMES:
        svc = sub.add_parser(name, help=f"run the {name} service")
        if name == "task-executor":
            svc.add_argument(
                "--pool-id",
                help="this node pool's name (MESHSERVE_POOL_ID); joins a running cluster",
            )
    args = p.parse_args(argv)

    if args.command == "up":
        from services.launcher import Launcher
        from shared.settings import Settings

        flags = {
            "http_port": args.port,
            "models_dir": args.models_dir,
            "pool_size": args.pool_size,
            "cluster": args.cluster,
        }
        settings = Settings.load(**{k: v for k, v in flags.items() if v is not None})
        sys.exit(Launcher(settings).run())
    if args.command == "profile":
        from pathlib import Path

        from services.task_executor.capacity import profile_model
        from shared.settings import Settings

        perf, where = profile_model(Path(args.model_dir), Settings.load())
        print(f"{args.model_dir}: performance model {where} ({perf.grid} grid)")
        print(f"  capacity: {perf.capacity()}")
        return
    if args.command == "infra-secrets":
        from pathlib import Path

        from services import infra_secrets
        from shared.settings import Settings

        cluster = Settings.load().cluster
        infra_secrets.write(
            Path(args.dir),
            cluster,
            owner=args.owner,
            nats_host=args.nats_host,
            redis_host=args.redis_host,
            redis_master=args.redis_master,
        )
        print(f"credentials for cluster {cluster!r} in {args.dir} (one user per role)")
        return
    if args.command == "health":
        sys.exit(_health(args.url))
    if args.command in admin_cli.COMMANDS:
        sys.exit(admin_cli.run(args))
    if args.command == "task-executor" and args.pool_id:
        from services.task_executor.pool import create
        from shared.runner import run_service
        from shared.settings import Settings

        run_service("task_executor", create, Settings.load(pool_id=args.pool_id))
        return
    sys.argv = [SERVICE_NAMES[args.command]]
    runpy.run_module(SERVICE_NAMES[args.command], run_name="__main__", alter_sys=True)


def _health(url: str | None) -> int:
    from shared import health
    from shared.settings import Settings

    if url:
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                status = json.load(r).get("status")
        except (OSError, ValueError) as e:
            print(f"unhealthy: {url}: {e}", file=sys.stderr)
            return 1
        print(f"{url}: {status}")
        return 0 if status == "ok" else 1
    settings = Settings.load()
    path = settings.membership.health_file
    if path is None:
        print("unhealthy: MESHSERVE_HEALTH_FILE is not set, so nothing reports", file=sys.stderr)
        return 2
    ok, why = health.check(path, settings.membership.liveness_timeout.total_seconds())
    print(why if ok else f"unhealthy: {why}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    main()
