"""``kilolined`` subcommands: run, check, keygen, fakegpu, demo, status."""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import os
import secrets
import sys
from collections.abc import Coroutine
from typing import Any

import orjson

from kilolined import __version__, fakegpu
from kilolined.cluster.persistence import warnings as redis_persistence_warnings
from kilolined.core.auth import digest, new_key
from kilolined.core.config import ConfigError, ServerConfig, default_config_path, load_config
from kilolined.core.targetglobs import adhoc_warnings
from kilolined.demo import run_demo
from kilolined.edge.server import serve
from kilolined.fakegpu.provider import Wire, run_provider
from kilolined.fakegpu.provider_runpod import RunPodWire
from kilolined.fakegpu.provider_vastai import VastWire
from kilolined.ops.probe import probe_all, slot_warnings
from kilolined.status import config_url, run_status, url_for_listen

FAKE_PROVIDER_PORT = 8790


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.name == "kilolined.access" and msg.startswith("{"):
            return msg
        return orjson.dumps(
            {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
             "msg": msg}
        ).decode()


def setup_logging(fmt: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-5s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def run_async(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def cmd_run(args: argparse.Namespace) -> int:

    path = default_config_path(args.config)
    try:
        cfg, version = load_config(path)
    except ConfigError as e:
        print(f"kilolined: invalid config {path}:", file=sys.stderr)
        for line in e.errors:
            print(f"  {line}", file=sys.stderr)
        return 1
    if args.listen:
        cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"listen": args.listen})})
    try:
        return run_async(serve(cfg, version, path, log_json=args.log_format == "json"))
    except ConfigError as e:  # found only at start: e.g. Redis refused the cluster's credentials
        print(f"kilolined: cannot start with {path}:", file=sys.stderr)
        for line in e.errors:
            print(f"  {line}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kilolined: cannot listen on {cfg.server.listen}: {e.strerror or e}", file=sys.stderr)
        return 1


def cmd_check(args: argparse.Namespace) -> int:
    """Like ``nginx -t``: every problem as ``file:line: dotted.path: message``, or one ok line
    that names the file; ``--probe`` then tries every node once."""
    path = default_config_path(args.config)
    try:
        cfg, _ = load_config(path)
    except ConfigError as e:
        for line in e.errors:
            print(line)
        return 1
    print(f"ok: {len(cfg.routes)} routes, {len(cfg.nodes)} nodes, {len(cfg.keys)} keys in {path}")
    for line in adhoc_warnings({k: kc.adhoc_targets for k, kc in cfg.keys.items()}):  # exit status unchanged
        print(line)
    if cfg.cluster is not None:
        # No payload on disk: say so when the shared Redis persists (a warning, exit status
        # unchanged). A Redis that refuses this gateway's credentials is an error.
        lines = asyncio.run(redis_persistence_warnings(cfg.cluster.redis_url))
        for line in lines:
            print(line)
        if any(line.startswith("error:") for line in lines):
            return 1
    if not args.probe:
        return 0
    probes = asyncio.run(probe_all(cfg))
    for p in probes:
        print(p.line())
    for line in asyncio.run(slot_warnings(cfg)):  # a warning: the exit status stays
        print(line)
    return 1 if any(not p.reachable for p in probes) else 0


def cmd_keygen(args: argparse.Namespace) -> int:
    if args.whsec:
        # 24 random bytes, as docs/CONFIG.md recommends for `jobs.webhook_secret`
        print("whsec_" + base64.b64encode(secrets.token_bytes(24)).decode())
        return 0
    key = new_key()
    name = args.id or "mykey"
    print(key)
    print()
    print("# paste under keys: in kiloline.yaml (the key itself is not stored, only its sha256)")
    print(f"  {name}:")
    print(f'    key_sha256: "{digest(key)}"')
    print('    routes: ["*"]')
    return 0


def cmd_fakegpu(args: argparse.Namespace) -> int:
    if args.provider:
        return run_fake_provider(args)
    port = 8188 if args.port is None else args.port
    return fakegpu.run(args.kind, host=args.host, port=port, api_key=args.api_key, **card_options(args),
                       models=[m.strip() for m in args.models.split(",") if m.strip()] if args.models else None,
                       swap_ms=args.swap_ms, warm_models=args.warm_models, slowdown=args.slowdown,
                       slowdown_after_sec=args.slowdown_after_sec, drift_pct_per_hour=args.drift_pct_per_hour,
                       prefill_ms_per_1k=args.prefill_ms_per_1k, prompt_cache_tokens=args.prompt_cache_tokens)


def card_options(args: argparse.Namespace) -> dict[str, Any]:
    """The card flags a lone card and a provider's cards both take."""
    return {"vram_gb": args.vram_gb, "job_vram_gb": args.job_vram_gb, "steps": args.steps,
            "step_ms": args.step_ms, "crash_sec": args.crash_sec, "ctx_size": args.ctx_size,
            "progress_min_sec": args.progress_min_ms / 1000, "capacity_mode": args.capacity_mode}


def run_fake_provider(args: argparse.Namespace) -> int:
    """`fakegpu --provider`: the fake market; the card flags apply to every instance's card."""
    wire: Wire = VastWire() if args.provider == "vastai" else RunPodWire()
    return run_provider(wire, host=args.host, port=FAKE_PROVIDER_PORT if args.port is None else args.port,
                        offers_path=args.offers, api_key=args.api_key, boot_sec=args.boot_sec,
                        default_kind=args.kind, card_options=card_options(args), resume_sec=args.resume_sec)


def cmd_demo(args: argparse.Namespace) -> int:
    return run_async(run_demo(once=args.once, port=args.port))


def cmd_status(args: argparse.Namespace) -> int:
    url = args.url
    if url is None:
        # The daemon's own server.listen, read from the file `run` would use; a file named by
        # -c or $KILOLINE_CONFIG must be readable, a default one may be absent.
        path = default_config_path(args.config)
        try:
            url = config_url(path, required=bool(args.config or os.environ.get("KILOLINE_CONFIG")))
        except ConfigError as e:
            for line in e.errors:
                print(f"kilolined status: {line} (or give --url)", file=sys.stderr)
            return 1
        url = url or url_for_listen(ServerConfig().listen, tls=False)
    return run_async(run_status(url, args.admin_key))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kilolined", description="KiloLine: a gateway for fragile GPU inference servers")
    p.add_argument("--version", action="version", version=f"kilolined {__version__}")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="log line format (stderr)")
    p.add_argument("--log-level", default="INFO", help=argparse.SUPPRESS)
    # The same options after the subcommand (`kilolined run --log-format json`); SUPPRESS keeps the
    # top-level value when they are not given there.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-format", choices=("text", "json"), default=argparse.SUPPRESS,
                        help="log line format (stderr)")
    common.add_argument("--log-level", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="cmd")

    r = sub.add_parser("run", parents=[common], help="run the daemon")
    r.add_argument("-c", "--config", help="config file (default: $KILOLINE_CONFIG, ./etc/kiloline.yaml, "
                                          "/etc/kiloline/kiloline.yaml)")
    r.add_argument("--listen", help="override server.listen (host:port)")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("check", parents=[common], help="validate a config file, like nginx -t",
                       description="Prints 'ok: N routes, M nodes, K keys in FILE' and exits 0, or one "
                                   "'FILE:LINE: dotted.path: message' line per problem and exits 1.")
    c.add_argument("-c", "--config")
    c.add_argument("--probe", action="store_true",
                   help="also connect to every node once (its health check, else GET /): one line per node; "
                        "exit 1 when one is unreachable")
    c.set_defaults(fn=cmd_check)

    k = sub.add_parser("keygen", parents=[common], help="print a new API key and the YAML to paste")
    k.add_argument("--id", help="key id to use in the YAML")
    k.add_argument("--whsec", action="store_true",
                   help="print a webhook signing secret (whsec_…, for jobs.webhook_secret) instead")
    k.set_defaults(fn=cmd_keygen)

    f = sub.add_parser("fakegpu", parents=[common], help="run a simulated GPU inference server")
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--port", type=int, default=None,
                   help=f"default 8188; with --provider: the API's port, default {FAKE_PROVIDER_PORT}")
    f.add_argument("--kind", choices=("generic", "comfyui", "openai"), default="generic",
                   help="with --provider: the kind of an instance whose image names none (docs/BACKENDS.md)")
    f.add_argument("--provider", choices=("vastai", "runpod"), default=None,
                   help="serve a fake Vast.ai or RunPod API whose instances are simulated cards")
    f.add_argument("--boot-sec", type=float, default=5.0,
                   help="with --provider: seconds from create until the instance's card answers")
    f.add_argument("--resume-sec", type=float, default=5.0,
                   help="with --provider: seconds from resuming a stopped instance until its card answers again")
    f.add_argument("--offers", default=None,
                   help="with --provider: a JSON file listing the offers (default: a built-in market)")
    f.add_argument("--vram-gb", type=float, default=24)
    f.add_argument("--job-vram-gb", type=float, default=10)
    f.add_argument("--capacity-mode", choices=("fixed", "request"), default="fixed",
                   help="request: each job takes the VRAM its request implies (docs/CONFIG.md)")
    f.add_argument("--steps", type=int, default=25)
    f.add_argument("--step-ms", type=float, default=200)
    f.add_argument("--crash-sec", type=float, default=5)
    f.add_argument("--api-key", help="openai: the key the node requires, as llama-server --api-key; "
                                     "with --provider: the key the provider API requires")
    f.add_argument("--ctx-size", type=int, default=4096, help="openai: context window in tokens (llama-server -c)")
    f.add_argument("--models", help="openai: comma-separated model ids it serves and swaps between "
                                    "(like llama-swap; default: one model, fake-llm)")
    f.add_argument("--swap-ms", type=float, default=0,
                   help="openai with --models: time to load a model that is not warm, before the first byte")
    f.add_argument("--warm-models", type=int, default=1,
                   help="openai with --models: models kept loaded at once (the first is warm at start)")
    f.add_argument("--progress-min-ms", type=float, default=100,
                   help="comfyui: drop progress updates closer than this (ComfyUI's ProgressBar; 0 sends all)")
    f.add_argument("--slowdown", type=float, default=1.0,
                   help="every step takes this many times longer (after --slowdown-after-sec): a GPU going slow")
    f.add_argument("--slowdown-after-sec", type=float, default=0.0, help="when --slowdown begins, from start")
    f.add_argument("--drift-pct-per-hour", type=float, default=0.0,
                   help="steps take this much longer for each hour the card has run (a slow drift)")
    f.add_argument("--prefill-ms-per-1k", type=float, default=0,
                   help="openai: GPU time per 1000 prompt tokens not in its prompt cache, before the first token")
    f.add_argument("--prompt-cache-tokens", type=int, default=32768,
                   help="openai: tokens its prompt cache holds at most (like llama-server --cache-ram; 0: none)")
    f.set_defaults(fn=cmd_fakegpu)

    d = sub.add_parser("demo", parents=[common], help="the traffic-smoothing demo on loopback")
    d.add_argument("--once", action="store_true", help="exit after the printout")
    d.add_argument("--port", type=int, default=8080, help="gateway port (0 = any free port)")
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("status", parents=[common], help="print routes and nodes from /admin/state")
    s.add_argument("-c", "--config", help="read the daemon's address from this config's server.listen "
                                          "(default: the file `run` would use)")
    s.add_argument("--url", default=None, help="the daemon's URL (default: from the config's server.listen, "
                                               "else http://127.0.0.1:8080)")
    s.add_argument("--admin-key", default=None, help="admin key (default: $KILOLINE_ADMIN_KEY)")
    s.set_defaults(fn=cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # No subcommand means `run`, options included: `kilolined -c /etc/kiloline/kiloline.yaml`.
    if not set(argv) & {"run", "check", "keygen", "fakegpu", "demo", "status", "-h", "--help", "--version"}:
        argv = ["run", *argv]
    args = p.parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    return int(args.fn(args) or 0)
