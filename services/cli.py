"""``turnrl serve`` and ``turnrl runs submit|list|status|logs|stop|delete``.

``cluster.cli`` hands over ``argv`` with the subcommand first. The runs commands talk to a
service through ``services.client`` (URL from ``--url`` or TURNRL_URL, token from TURNRL_TOKEN
or ``--token-file``: never a command-line argument, where ``ps`` would show it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

TERMINAL = ("succeeded", "stopped", "failed", "lost")


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="turnrl serve", description="Run the REST API, metrics and dashboard.")
    p.add_argument("--config", help="service YAML (deploy/service.yaml); defaults if omitted")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a service config key, e.g. --set port=9000; repeatable")
    p.add_argument("--stop-local-ray", action="store_true",
                   help="stop the local Ray head this service started (its runs end with it), then exit")
    return p


def _runs_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="turnrl runs", description="Talk to a running `turnrl serve`.")
    p.add_argument("--url", help="service URL (default: TURNRL_URL or http://127.0.0.1:8321)")
    p.add_argument("--token-file", help="file holding the API token (default: TURNRL_TOKEN)")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    submit = sub.add_parser("submit", help="submit a RunConfig YAML; prints the run id")
    submit.add_argument("config", nargs="?", help="RunConfig YAML (defaults if omitted)")
    submit.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    sub.add_parser("list", help="your runs")
    sub.add_parser("pools", help="the engine pools a LoRA run may attach to (rollout.pool)")
    for name, text in (("status", "status, step, latest metrics, checkpoints"), ("stop", "graceful stop"),
                       ("delete", "forget a finished run and delete its files")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("run_id")
    logs = sub.add_parser("logs", help="the run's output")
    logs.add_argument("run_id")
    logs.add_argument("--tail", type=int, help="last N lines")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    sub.choices["stop"].add_argument("--wait", action="store_true", help="wait until the run has stopped")
    sub.choices["delete"].add_argument("--keep-files", action="store_true", help="keep the run directory")
    return p


def _serve(argv: list[str]) -> int:
    from services.config import ServiceConfigError, load_service_config

    args = _serve_parser().parse_args(argv)
    try:
        cfg = load_service_config(args.config, args.overrides)
        from services.server import serve, stop_local_ray

        return stop_local_ray(cfg) if args.stop_local_ray else serve(cfg)
    except ServiceConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _submit_body(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    from cluster.config import apply_overrides

    tree = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    return apply_overrides(tree or {}, args.overrides)


def _print_run(run: dict[str, Any]) -> None:
    keys = ("reward/outcome_mean", "rollout/success_rate", "throughput/gen_tokens_per_s", "staleness/mean")
    print(f"{run['id']}  {run['status']}  step {run['step']}/{run['total_steps']}  owner {run['owner']}")
    metrics = {k: run["metrics"][k] for k in keys if run.get("metrics", {}).get(k) is not None}
    if metrics:
        print("  " + "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    for ckpt in run.get("checkpoints", []):
        print(f"  checkpoint {ckpt['name']}: {ckpt['path']}")
    if run.get("message"):
        print(f"  {run['message']}")


def _runs(argv: list[str]) -> int:
    import httpx

    from services.client import ServiceClient, ServiceError

    args = _runs_parser().parse_args(argv)
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    try:
        with ServiceClient(args.url, token) as client:
            return _run_action(client, args)
    except ServiceError as exc:
        detail = exc.detail
        if isinstance(detail, list):  # 422: one line per failing key
            detail = "\n".join(f"  {e['loc']}: {e['msg']}" for e in detail)
        print(f"error: HTTP {exc.status}: {detail}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"error: cannot talk to the service: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run_action(client: Any, args: argparse.Namespace) -> int:
    if args.action == "submit":
        print(client.submit(_submit_body(args))["id"])
    elif args.action == "list":
        for run in client.list():
            print(f"{run['id']}\t{run['status']}\t{run['step']}/{run['total_steps']}")
    elif args.action == "pools":
        for pool in client.pools():
            print(f"{pool['name']}\t{pool['status']}\t{pool['attached']}/{pool['max_adapters']} runs "
                  f"({pool['mine']} yours)\t{pool['engines']} {pool['engine']} engine(s) of {pool['model']}"
                  + (", one learner for every run" if pool.get("learner") else ""))
    elif args.action == "status":
        _print_run(client.status(args.run_id))
    elif args.action == "logs":
        if args.follow:
            for chunk in client.follow_logs(args.run_id, args.tail):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        else:
            sys.stdout.write(client.logs(args.run_id, args.tail))
    elif args.action == "stop":
        run = client.stop(args.run_id)
        while args.wait and run["status"] not in TERMINAL:
            time.sleep(1.0)
            run = client.status(args.run_id)
        print(json.dumps({"id": run["id"], "status": run["status"]}))
    elif args.action == "delete":
        client.delete(args.run_id, keep_files=args.keep_files)
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("serve", "runs"):
        print("usage: turnrl serve ... | turnrl runs ...", file=sys.stderr)
        return 2
    return _serve(argv[1:]) if argv[0] == "serve" else _runs(argv[1:])
