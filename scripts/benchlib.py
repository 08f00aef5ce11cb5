"""Shared helpers for the proof-under-load scripts (bench_*.py, soak.py, chaos.py).

Everything here talks to 127.0.0.1 only. Every process started through ``Procs`` lives in its own
process group and is stopped (SIGTERM, then SIGKILL) when the ``with`` block ends, whatever
happened inside it. Configs and logs go to a temporary directory that is removed at the end, so
a script writes nothing but its own output (and ``--json`` when asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PYTHON = sys.executable
KILOLINED = str(BIN / "kilolined") if (BIN / "kilolined").exists() else shutil.which("kilolined") or "kilolined"
WRK = shutil.which("wrk") or "/usr/bin/wrk"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
TASKSET = shutil.which("taskset")
NCPU = os.cpu_count() or 1
CLK_TCK = os.sysconf("SC_CLK_TCK")

ADMIN_KEY = "kl_bench_admin_0000000000000000000000"
API_KEY = "kl_bench_user_00000000000000000000000"
ADMIN_HDR = {"Authorization": f"Bearer {ADMIN_KEY}"}
API_HDR = {"Authorization": f"Bearer {API_KEY}"}


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# --------------------------------------------------------------------------- the machine


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, RAM, load and the versions that matter, for the tables' headers."""
    info: dict[str, Any] = {"nproc": NCPU}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["ram_gb"] = round(int(line.split()[1]) / 1024 / 1024, 1)
    with contextlib.suppress(OSError):
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    info["python"] = sys.version.split()[0]
    for mod in ("aiohttp", "uvloop"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    return info


def print_machine() -> dict[str, Any]:
    m = machine_info()
    print(f"# machine: {m.get('nproc')} cpu ({m.get('cpu', '?')}), {m.get('ram_gb', '?')} GB RAM, "
          f"load {' '.join(m.get('loadavg', []))}; python {m['python']}, aiohttp {m['aiohttp']}, "
          f"uvloop {m['uvloop']}")
    return m


def raise_nofile(want: int = 1 << 20) -> int:
    """Raise the soft RLIMIT_NOFILE as far as the hard limit allows (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (want, hard):
        target = min(target, hard) if hard != resource.RLIM_INFINITY else target
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(target, hard)))
            return target
        except (ValueError, OSError):
            continue
    return soft


def install_sigterm_exit() -> None:
    """SIGTERM raises SystemExit so that every ``finally`` (and ``Procs``) still runs."""

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


# --------------------------------------------------------------------------- ports and processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 15.0, proc: subprocess.Popen[Any] | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening on {port}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def wait_closed(port: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.05)


def http_json(url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None,
              timeout: float = 10.0) -> Any:
    """A blocking loopback JSON call (urllib), for control endpoints between load phases."""
    assert url.startswith("http://127.0.0.1:"), url
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raw = e.read()
    return json.loads(raw) if raw else None


def pinned(cmd: Sequence[str], cpu: str | int | None) -> list[str]:
    """Prefix ``taskset -c CPU`` when asked and possible (one-core boxes run unpinned)."""
    if cpu is None or TASKSET is None or NCPU < 2:
        return list(cmd)
    return [TASKSET, "-c", str(cpu), *cmd]


class Procs:
    """Start subprocesses, each in its own process group; stop them all when the block ends."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, cmd: Sequence[str], name: str, cpu: str | int | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        try:
            p = subprocess.Popen(pinned(cmd, cpu), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd=self.workdir, env=env)
        finally:
            log.close()
        p.kl_name = name  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def log_tail(self, name: str, n: int = 20) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, p: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        else:
            # The leader is gone; make sure nothing of its group lingers.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        if p in self.procs:
            self.procs.remove(p)

    def kill(self, p: subprocess.Popen[bytes]) -> None:
        """SIGKILL the whole group (a spot machine vanishing)."""
        self.stop(p, sig=signal.SIGKILL, timeout=5)

    def stop_all(self) -> None:
        for p in reversed(list(self.procs)):
            try:
                self.stop(p)
            except Exception as e:  # keep stopping the others
                print(f"warning: could not stop {getattr(p, 'kl_name', p.pid)}: {e}", file=sys.stderr)


@contextlib.contextmanager
def workdir(prefix: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=f"kl-{prefix}-"))
    try:
        yield d
    finally:
        if os.environ.get("KL_BENCH_KEEP"):
            print(f"(kept {d})", file=sys.stderr)
        else:
            shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- the things we run


def fakegpu_cmd(port: int, steps: int = 0, step_ms: float = 0, vram_gb: float = 1e6, job_vram_gb: float = 0,
                kind: str = "generic", crash_sec: float = 1) -> list[str]:
    return [KILOLINED, "fakegpu", "--kind", kind, "--port", str(port), "--steps", str(steps),
            "--step-ms", str(step_ms), "--vram-gb", str(vram_gb), "--job-vram-gb", str(job_vram_gb),
            "--crash-sec", str(crash_sec)]


def gateway_config(port: int, nodes: dict[str, str], routes: dict[str, dict[str, Any]] | None = None,
                   **server: Any) -> dict[str, Any]:
    """A gateway config: one key (API_KEY), the admin key, access log off, the given nodes/routes.

    ``routes`` defaults to one generic route ``gen`` at ``/gen`` over the first node.
    """
    if routes is None:
        routes = {"gen": {"path": "/gen", "nodes": [next(iter(nodes))], "max_concurrency": 512,
                          "max_queue_depth": 100000, "queue_timeout_sec": 600, "request_timeout_sec": 600}}
    srv = {"listen": f"127.0.0.1:{port}", "access_log": False, "shutdown_grace_sec": 2}
    srv.update(server)
    return {
        "server": srv,
        "admin": {"key_sha256": sha(ADMIN_KEY), "public_metrics": True},
        "keys": {"bench": {"key_sha256": sha(API_KEY), "routes": ["*"]}},
        "nodes": {n: {"url": u} if isinstance(u, str) else u for n, u in nodes.items()},
        "routes": routes,
    }


def write_yaml(path: Path, data: dict[str, Any]) -> None:
    """Atomic write (rename), as an operator's editor would."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)


GC_WRAPPER = """
import gc, os, sys, time
pauses = {0: [], 1: [], 2: []}
started = [0.0]
def cb(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        pauses[info["generation"]].append((time.perf_counter() - started[0]) * 1000)
gc.callbacks.append(cb)
if os.environ.get("KL_GC_NO_FREEZE"):
    gc.freeze = lambda: None  # neutralise the daemon's own gc.freeze() after start, for an A/B
if os.environ.get("KL_GC_FREEZE"):
    import kilolined.edge.server as srv
    _start = srv.Server.start
    async def start(self):
        await _start(self)
        gc.collect()
        gc.freeze()
        print(f"GCSTAT frozen {gc.get_freeze_count()} objects after start", file=sys.stderr, flush=True)
    srv.Server.start = start
from kilolined.cli import main
try:
    sys.exit(main(sys.argv[1:]))
finally:
    print(f"GCSTAT frozen objects at exit: {gc.get_freeze_count()}", file=sys.stderr, flush=True)
    for g, v in pauses.items():
        v.sort()
        if v:
            print(f"GCSTAT gen{g} n={len(v)} total_ms={sum(v):.1f} max_ms={v[-1]:.2f} "
                  f"p50_ms={v[len(v) // 2]:.3f}", file=sys.stderr, flush=True)
"""


def gc_stats(log_text: str) -> list[str]:
    return [ln.split("GCSTAT ", 1)[1] for ln in log_text.splitlines() if "GCSTAT " in ln]


def start_gateway(procs: Procs, cfg: dict[str, Any], name: str = "gateway", cpu: str | int | None = None,
                  extra: Sequence[str] = (), gc_trace: bool = False, gc_freeze: bool = False,
                  gc_no_freeze: bool = False) -> tuple[subprocess.Popen[bytes], Path]:
    """`kilolined run -c` on a config written to the workdir. gc_trace: the same daemon run through a
    wrapper that records cyclic-GC pauses (GCSTAT lines in its log at exit); gc_freeze also calls
    gc.freeze() once it listens, gc_no_freeze turns the daemon's own gc.freeze() into a no-op
    (experiments, not product changes)."""
    path = procs.workdir / f"{name}.yaml"
    write_yaml(path, cfg)
    cmd = [KILOLINED, "--log-format", "text", "run", "-c", str(path), *extra]
    env = None
    if gc_trace or gc_freeze or gc_no_freeze:
        wrapper = procs.workdir / "gcwrap.py"
        wrapper.write_text(GC_WRAPPER)
        cmd = [PYTHON, str(wrapper), *cmd[1:]]
        env = {**os.environ, **({"KL_GC_FREEZE": "1"} if gc_freeze else {}),
               **({"KL_GC_NO_FREEZE": "1"} if gc_no_freeze else {})}
    p = procs.start(cmd, name, cpu=cpu, env=env)
    port = int(cfg["server"]["listen"].rsplit(":", 1)[1])
    try:
        wait_port(port, proc=p)
    except (RuntimeError, TimeoutError):
        print(procs.log_tail(name), file=sys.stderr)
        raise
    return p, path


def start_fakegpu(procs: Procs, port: int, name: str, cpu: str | int | None = None, **kw: Any
                  ) -> subprocess.Popen[bytes]:
    p = procs.start(fakegpu_cmd(port, **kw), name, cpu=cpu)
    wait_port(port, proc=p)
    return p


def _nginx_prelude(d: Path) -> str:
    """One worker, no logs, temp files in the workdir, keep-alive without limits: the part every
    nginx of the benchmarks shares; the caller adds the rest of the http block and closes it."""
    return f"""
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
worker_rlimit_nofile 20000;
events {{ worker_connections 16000; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 600s;
"""


def nginx_conf(workdir: Path, listen: int, upstream_port: int, *, buffering: bool = True,
               keepalive: int = 512) -> Path:
    d = workdir / "nginx"
    d.mkdir(exist_ok=True)
    text = _nginx_prelude(d) + f"""
    upstream node {{
        server 127.0.0.1:{upstream_port};
        keepalive {keepalive};
        keepalive_requests 10000000;
        keepalive_timeout 600s;
    }}
    server {{
        listen 127.0.0.1:{listen} backlog=4096;
        location / {{
            proxy_pass http://node;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 600s;
            proxy_buffering {"on" if buffering else "off"};
            {"" if buffering else "proxy_buffer_size 64k; proxy_buffers 8 64k; proxy_busy_buffers_size 128k;"}
            proxy_max_temp_file_size 0;
        }}
    }}
}}
"""
    path = d / "nginx.conf"
    path.write_text(text)
    return path


def start_nginx_origin(procs: Procs, listen: int, cpu: str | int | None = None) -> subprocess.Popen[bytes]:
    """A zero-delay upstream written in C: nginx, one worker, `return 200` with a small JSON body.

    Against a Python node every proxy looks alike (the node is the bottleneck); against this one
    the proxy under test is what is measured.
    """
    d = procs.workdir / "origin"
    d.mkdir(exist_ok=True)
    conf = d / "nginx.conf"
    conf.write_text(_nginx_prelude(d) + f"""
    server {{
        listen 127.0.0.1:{listen} backlog=4096;
        location / {{
            default_type application/json;
            return 200 '{{"ok": true}}';
        }}
    }}
}}
""")
    p = procs.start([NGINX, "-p", str(d), "-e", str(d / "error.log"), "-c", str(conf)], "origin", cpu=cpu)
    wait_port(listen, proc=p)
    return p


def start_nginx(procs: Procs, listen: int, upstream_port: int, cpu: str | int | None = None,
                **kw: Any) -> subprocess.Popen[bytes]:
    conf = nginx_conf(procs.workdir, listen, upstream_port, **kw)
    p = procs.start([NGINX, "-p", str(conf.parent), "-e", str(conf.parent / "error.log"), "-c", str(conf)],
                    "nginx", cpu=cpu)
    try:
        wait_port(listen, proc=p)
    except (RuntimeError, TimeoutError):
        print(procs.log_tail("nginx"), (conf.parent / "error.log").read_text()[-2000:], file=sys.stderr)
        raise
    return p


def haproxy_conf(workdir: Path, listen: int, upstream_port: int, *, server_maxconn: int = 10000,
                 global_maxconn: int = 9000, stats_port: int | None = None) -> Path:
    d = workdir / "haproxy"
    d.mkdir(exist_ok=True)
    stats = "" if stats_port is None else f"""
listen stats
    bind 127.0.0.1:{stats_port}
    stats enable
    stats uri /stats
"""
    text = f"""
global
    maxconn {global_maxconn}
    nbthread 1

defaults
    mode http
    option http-keep-alive
    http-reuse always
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    timeout queue 600s
    timeout http-keep-alive 600s

frontend fe
    bind 127.0.0.1:{listen}
    maxconn {global_maxconn if stats_port is None else max(1, global_maxconn - 50)}
    default_backend be

backend be
    server node 127.0.0.1:{upstream_port} maxconn {server_maxconn}
{stats}"""
    path = d / "haproxy.cfg"
    path.write_text(text)
    return path


def haproxy_max_maxconn() -> int:
    """HAProxy needs ~2 × maxconn + a few fds and refuses to start otherwise: the largest maxconn
    the hard RLIMIT_NOFILE allows (clients beyond it wait in the listen backlog)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 30 if hard == resource.RLIM_INFINITY else (hard - 300) // 2


def start_haproxy(procs: Procs, listen: int, upstream_port: int, cpu: str | int | None = None,
                  **kw: Any) -> subprocess.Popen[bytes]:
    conf = haproxy_conf(procs.workdir, listen, upstream_port, **kw)
    p = procs.start([HAPROXY, "-db", "-f", str(conf)], "haproxy", cpu=cpu)
    try:
        wait_port(listen, proc=p)
    except (RuntimeError, TimeoutError):
        print(procs.log_tail("haproxy"), file=sys.stderr)
        raise
    return p


# --------------------------------------------------------------------------- /proc readings


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (kB) and Threads from /proc/<pid>/status."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "Threads"):
            out[k] = int(v.split()[0])
    return out


def rss_kb(pid: int) -> int:
    return proc_status(pid)["VmRSS"]


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all threads), in seconds."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def fd_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def main_pid(p: subprocess.Popen[bytes]) -> int:
    """The pid to measure: through ``taskset`` the Popen pid is the exec'd program itself."""
    return p.pid


# --------------------------------------------------------------------------- numbers


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    s = sorted(values)
    if len(s) == 1:
        return float(s[0])
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.{nd}f}"
    return str(v)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], nd: int = 2) -> str:
    """A GitHub-markdown table on stdout (and returned), so results paste into the docs."""
    cells = [[fmt(c, nd) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in cells:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(path: str | None, data: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str))
        print(f"(results written to {path})")


# --------------------------------------------------------------------------- wrk


WRK_LUA = """
wrk.method = "{method}"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {{\\"requests\\": %d, \\"duration_us\\": %d, \\"p50_us\\": %.1f, \\"p95_us\\": %.1f, " ..
    "\\"p99_us\\": %.1f, \\"mean_us\\": %.1f, \\"max_us\\": %.1f, \\"err_connect\\": %d, \\"err_read\\": %d, " ..
    "\\"err_write\\": %d, \\"err_status\\": %d, \\"err_timeout\\": %d}}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(95),
    latency:percentile(99), latency.mean, latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


async def post_keepalive(url: str, n: int, conc: int = 8, body: bytes = b'{"steps": 0}') -> None:
    """``n`` POSTs of ``body`` over ``conc`` keep-alive connections, with the bench key; every
    answer must be a 200 (the callgrind and opcode counts are per request served)."""
    left = n
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as s:
        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with s.post(url, data=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                    await r.read()
                    assert r.status == 200, r.status

        await asyncio.gather(*(worker() for _ in range(conc)))


async def post_counted(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                       outcomes: dict[str, int], body: bytes = b'{"steps": 0}') -> None:
    """One POST; its outcome counted in ``outcomes``: the status for a success, "status type" for
    the gateway's JSON error, "client error X" when the connection failed."""
    try:
        async with session.post(url, data=body, headers=headers) as r:
            raw = await r.read()
            if r.status < 300:
                outcomes[str(r.status)] += 1
                return
            try:
                kind = json.loads(raw)["error"]["type"]
            except (ValueError, KeyError, TypeError):
                kind = "non-json"
            outcomes[f"{r.status} {kind}"] += 1
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        outcomes[f"client error {type(e).__name__}"] += 1


def wrk_script(workdir: Path, method: str = "POST", body: str = '{"steps": 0}', key: str = API_KEY) -> Path:
    path = workdir / f"wrk-{method.lower()}.lua"
    path.write_text(WRK_LUA.format(method=method, body=body, key=key))
    return path


def run_wrk(url: str, script: Path, connections: int, seconds: float, threads: int = 1,
            cpu: str | int | None = None, timeout_s: int = 10) -> dict[str, Any]:
    assert url.startswith("http://127.0.0.1:"), url
    threads = max(1, min(threads, connections))
    cmd = pinned([WRK, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
                  f"--timeout={timeout_s}s", "-s", str(script), url], cpu)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + timeout_s + 30, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("WRKJSON "):
            r = json.loads(line[len("WRKJSON "):])
            r["rps"] = r["requests"] / (r["duration_us"] / 1e6) if r["duration_us"] else 0.0
            r["errors"] = r["err_connect"] + r["err_read"] + r["err_write"] + r["err_status"] + r["err_timeout"]
            return r
    raise RuntimeError(f"wrk gave no result (rc={out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}")


def haproxy_stats(stats_port: int) -> list[dict[str, str]]:
    """HAProxy's stats CSV (qcur = requests waiting in its queue, scur = current sessions)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stats_port}/stats;csv", timeout=5) as r:
        lines = r.read().decode().splitlines()
    head = lines[0].lstrip("# ").split(",")
    return [dict(zip(head, ln.split(","), strict=False)) for ln in lines[1:] if ln]


# --------------------------------------------------------------------------- profiling (py-spy)


def find_pyspy() -> str | None:
    """``$PYSPY`` or ``py-spy`` on PATH (``pip install py-spy``; any location works)."""
    return os.environ.get("PYSPY") or shutil.which("py-spy")


def pyspy_record(pid: int, seconds: float, out: Path, rate: int = 200) -> subprocess.Popen[bytes] | None:
    """Start ``py-spy record --gil`` (only samples holding the GIL: real Python work; the idle
    watchfiles thread in native code would otherwise show up as busy) in raw (folded) format."""
    exe = find_pyspy()
    if exe is None:
        return None
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", str(rate),
                             "--gil", "--nonblocking", "--format", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


PROFILE_GROUPS = (
    ("aiohttp client (upstream request/response)", ("aiohttp/client", "aiohttp/connector")),
    ("aiohttp server (protocol, request, response)", ("aiohttp/web_protocol", "aiohttp/web_request",
                                                      "aiohttp/web_response", "aiohttp/web_app")),
    ("aiohttp http writer (both directions)", ("aiohttp/http_writer", "aiohttp/payload")),
    ("aiohttp router", ("web_urldispatcher",)),
    ("kiloline budgets (Budgets.add/_roll/utc_day)", ("kilolined/scheduling/limits.py",)),
    ("prometheus_client (labels/inc/observe)", ("prometheus_client/",)),
    ("kiloline scheduler (queue.py)", ("kilolined/scheduling/queue.py",)),
    ("kiloline auth (sha256 lookup)", ("kilolined/core/auth.py",)),
    ("kiloline runtime (admit/wake/release)", ("kilolined/ops/runtime.py",)),
    ("kiloline proxy headers (proxy.py)", ("kilolined/wire/proxy.py",)),
    ("kiloline nodes/stats/app glue", ("kilolined/scheduling/nodes.py", "kilolined/ops/stats.py",
                                       "kilolined/edge/app.py",
                                       "kilolined/forward.py")),
    ("uuid4 request ids", ("uuid.py",)),
    ("logging", ("logging/",)),
)


def summarize_pyspy(raw: Path, top: int = 15) -> dict[str, Any]:
    """Self time per frame, inclusive time per frame, and the share of each PROFILE_GROUPS group
    (each sample goes to the deepest frame that matches a group)."""
    self_c: dict[str, int] = {}
    incl: dict[str, int] = {}
    groups: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n_s = line.rpartition(" ")
        if not stack or not n_s.isdigit():
            continue
        n = int(n_s)
        total += n
        frames = stack.split(";")
        self_c[frames[-1]] = self_c.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
        for f in reversed(frames):
            g = next((name for name, pats in PROFILE_GROUPS if any(p in f for p in pats)), None)
            if g is not None:
                groups[g] = groups.get(g, 0) + n
                break
        else:
            groups["other (event loop, asyncio)"] = groups.get("other (event loop, asyncio)", 0) + n

    def pct(d: dict[str, int], k: int) -> list[tuple[str, float]]:
        return [(f, 100.0 * v / total) for f, v in sorted(d.items(), key=lambda kv: -kv[1])[:k]]

    kl_incl = {f: v for f, v in incl.items() if "kilolined/" in f}
    return {"samples": total, "self": pct(self_c, top), "groups": pct(groups, 30),
            "kiloline_inclusive": pct(kl_incl, top)}


# --------------------------------------------------------------------------- sockets of a process


def tcp_sockets(pid: int | str = "self") -> list[tuple[int, int, str]]:
    """(local port, remote port, state hex) of every TCP socket the process has open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            parts = ln.split()
            if len(parts) > 9 and parts[9] in inodes:
                out.append((int(parts[1].rsplit(":", 1)[1], 16), int(parts[2].rsplit(":", 1)[1], 16), parts[3]))
    return out


def fd_breakdown(pid: int | str, pool_ports: set[int]) -> dict[str, int]:
    """Open fds, and how many are ESTABLISHED keep-alive sockets to/from `pool_ports` (upstream
    pools of nodes and notifier channels: legitimately open while idle, closed by their peers)."""
    total = fd_count(pid)
    pooled = sum(1 for lp, rp, st in tcp_sockets(pid) if st == "01" and (rp in pool_ports or lp in pool_ports))
    return {"fds": total, "pooled": pooled, "fds_nonpool": total - pooled}
