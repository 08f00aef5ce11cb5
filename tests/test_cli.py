"""`kilolined` as a user runs it: subprocesses of `python -m kilolined` (SPEC §1)."""

from __future__ import annotations

import asyncio
import hashlib
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from cli_run import ENV, PY, ROOT, kl

ENV.pop("KILOLINE_CONFIG", None)
DOTTED = re.compile(r"^\S+:\d+: [^\s:]+(?: [^:]+)?: .+$")  # file:line: dotted.path: message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 15) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listening on {port}")


# --- check --------------------------------------------------------------------------------------


def test_check_example_config() -> None:
    r = kl("check", "-c", "etc/kiloline.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "ok: 3 routes, 4 nodes, 2 keys in etc/kiloline.yaml"


def test_check_without_env_var_fails_naming_it() -> None:
    env = {k: v for k, v in ENV.items() if k != "KILOLINE_ADMIN_KEY"}
    r = kl("check", "-c", "etc/kiloline.yaml", env=env)
    assert r.returncode == 1
    assert "KILOLINE_ADMIN_KEY" in r.stdout + r.stderr


def test_check_bad_file_prints_dotted_paths(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "server": {"listen": "nope"},
        "nodes": {"gpu": {"url": "http://127.0.0.1:1"}},
        "routes": {"gen": {"path": "/gen", "nodes": ["gpu", "ghost"], "max_concurency": 2}},
        "keys": {"k": {"key": "x", "routes": ["missing"]}},
    }))
    r = kl("check", "-c", str(bad))
    assert r.returncode == 1
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert lines
    for ln in lines:
        assert DOTTED.match(ln) and ln.startswith(f"{bad}:"), ln
    text = "\n".join(lines)
    assert "server.listen:" in text
    assert "routes.gen.max_concurency: unknown key" in text
    assert "ok:" not in r.stdout


def test_check_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("routes: [unclosed\n")
    r = kl("check", "-c", str(bad))
    assert r.returncode == 1 and r.stdout.strip()
    r = kl("check", "-c", str(tmp_path / "missing.yaml"))
    assert r.returncode == 1 and "missing.yaml" in r.stdout + r.stderr


def test_check_uses_kiloline_config_env(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"nodes": {"g": {"url": "http://127.0.0.1:1"}},
                                    "routes": {"r": {"path": "/r", "nodes": ["g"]}}}))
    r = kl("check", env={**ENV, "KILOLINE_CONFIG": str(good)})
    assert r.returncode == 0 and r.stdout == f"ok: 1 routes, 1 nodes, 0 keys in {good}\n"


def test_check_duplicate_route_names_the_line(tmp_path: Path) -> None:
    f = tmp_path / "dup.yaml"
    f.write_text("nodes:\n  g: {url: 'http://127.0.0.1:1'}\nroutes:\n  r: {path: /r, nodes: [g]}\n"
                 "  r: {path: /s, nodes: [g]}\n")
    r = kl("check", "-c", str(f))
    assert (r.returncode, r.stdout) == (1, f"{f}:5: routes.r: duplicate key (first at line 4)\n")


def test_check_probe_reports_every_node(tmp_path: Path) -> None:
    async def main() -> None:
        async def health(_r: aiohttp.web.Request) -> aiohttp.web.Response:
            return aiohttp.web.Response(text="fine")

        app = aiohttp.web.Application()
        app.router.add_get("/stats", health)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        dead = free_port()
        cfg = {"nodes": {"up": {"url": f"http://u:pw@127.0.0.1:{port}", "health": {"path": "/stats"}},
                         "down": {"url": f"http://127.0.0.1:{dead}"}},
               "routes": {"r": {"path": "/r", "nodes": ["up", "down"]}}}
        f = tmp_path / "k.yaml"
        f.write_text(yaml.safe_dump(cfg, sort_keys=False))
        p = await asyncio.create_subprocess_exec(PY, "-m", "kilolined", "check", "--probe", "-c", str(f), cwd=ROOT,
                                                 env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, _ = await asyncio.wait_for(p.communicate(), 30)
        lines = out.decode().splitlines()
        assert p.returncode == 1, lines
        assert lines[0] == f"ok: 1 routes, 2 nodes, 0 keys in {f}"
        assert re.fullmatch(rf"node up: reachable, HTTP 200 ok \(http://127.0.0.1:{port}/stats, \d+ ms\)", lines[1])
        down = rf"node down: unreachable: cannot connect \(connection refused\) \(http://127.0.0.1:{dead}/, \d+ ms\)"
        assert re.fullmatch(down, lines[2]), lines
        assert "pw" not in out.decode()
        cfg["nodes"].pop("down")
        cfg["routes"]["r"]["nodes"] = ["up"]
        f.write_text(yaml.safe_dump(cfg))
        p = await asyncio.create_subprocess_exec(PY, "-m", "kilolined", "check", "--probe", "-c", str(f), cwd=ROOT,
                                                 env=ENV, stdout=subprocess.PIPE)
        out, _ = await asyncio.wait_for(p.communicate(), 30)
        assert p.returncode == 0 and len(out.decode().splitlines()) == 2
        await runner.cleanup()

    asyncio.run(main())


# --- keygen -------------------------------------------------------------------------------------


def test_keygen() -> None:
    r = kl("keygen", "--id", "x")
    assert r.returncode == 0
    key = r.stdout.splitlines()[0].strip()
    assert re.fullmatch(r"kl_[A-Za-z0-9_-]{32}", key) and len(key) == 35
    m = re.search(r'key_sha256:\s*"?([0-9a-f]{64})"?', r.stdout)
    assert m and m.group(1) == hashlib.sha256(key.encode()).hexdigest()
    assert re.search(r"^\s*x:\s*$", r.stdout, re.M)
    # the pasted YAML is valid config
    snippet = "keys:\n" + "\n".join(ln for ln in r.stdout.splitlines()[1:] if ln.startswith("  "))
    doc = yaml.safe_load(snippet)
    assert doc["keys"]["x"]["key_sha256"] == m.group(1)
    # keys are random
    assert kl("keygen").stdout.splitlines()[0] != key


# --- help ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["run", "check", "keygen", "fakegpu", "demo", "status"])
def test_every_subcommand_has_help(cmd: str) -> None:
    r = kl(cmd, "--help")
    assert r.returncode == 0
    assert r.stdout.startswith("usage:") and f"kilolined {cmd}" in r.stdout


def test_top_level_help_lists_subcommands() -> None:
    r = kl("--help")
    assert r.returncode == 0
    for cmd in ("run", "check", "keygen", "fakegpu", "demo", "status"):
        assert cmd in r.stdout


# --- run ----------------------------------------------------------------------------------------


def test_run_with_invalid_config_exits_nonzero(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"nodes": {"g": {"url": "http://127.0.0.1:1"}},
                                   "routes": {"r": {"path": "/r", "nodes": ["nope"]}},
                                   "server": {"listen": "127.0.0.1:0"}}))
    r = kl("run", "-c", str(bad), timeout=20)
    assert r.returncode != 0
    assert str(bad) in r.stderr and "routes.r.nodes.0" in r.stderr
    r = kl("run", "-c", str(tmp_path / "nope.yaml"), timeout=20)
    assert r.returncode != 0 and "nope.yaml" in r.stderr


def test_no_subcommand_means_run(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: {listen: nope}\n")
    r = kl(env={**ENV, "KILOLINE_CONFIG": str(bad)}, timeout=20)
    assert r.returncode != 0
    assert "server.listen" in r.stderr
    # ...options included: `kilolined -c FILE` is `kilolined run -c FILE`.
    r = kl("--log-format", "json", "-c", str(bad), timeout=20)
    assert r.returncode == 1 and "server.listen" in r.stderr


async def test_run_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    gpu_port, gw_port = free_port(), free_port()
    key = "kl_cli_test_key_0000000000000000000"
    cfg = {
        "server": {"listen": f"127.0.0.1:{gw_port}", "shutdown_grace_sec": 5},
        "keys": {"alice": {"key_sha256": hashlib.sha256(key.encode()).hexdigest()}},
        "nodes": {"gpu": {"url": f"http://127.0.0.1:{gpu_port}"}},
        "routes": {"gen": {"path": "/gen", "nodes": ["gpu"], "max_concurrency": 1}},
    }
    path = tmp_path / "kiloline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    gpu = subprocess.Popen([PY, "-m", "kilolined", "fakegpu", "--kind", "generic", "--port", str(gpu_port),
                            "--steps", "1", "--step-ms", "5"], cwd=ROOT, env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    gw = subprocess.Popen([PY, "-m", "kilolined", "run", "-c", str(path)], cwd=ROOT, env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        await asyncio.to_thread(wait_port, gpu_port)
        await asyncio.to_thread(wait_port, gw_port)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{gw_port}/healthz") as r:
                assert r.status == 200
            async with http.post(f"http://127.0.0.1:{gw_port}/gen/generate", json={"echo": "cli"},
                                 headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200
                assert (await r.json())["echo"] == "cli"
                assert r.headers["X-KiloLine-Node"] == "gpu"
        t0 = time.monotonic()
        gw.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(gw.wait, 10)
        assert rc == 0
        assert time.monotonic() - t0 < 5
        out, err = gw.communicate()
        assert out == b""  # logs go to stderr
        assert err
    finally:
        for p in (gw, gpu):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    assert gpu.returncode == 0


def test_check_passes_the_multi_model_keys(tmp_path: Path) -> None:
    good = tmp_path / "models.yaml"
    good.write_text(yaml.safe_dump({
        "nodes": {"box": {"url": "http://127.0.0.1:1", "models": ["a", "b"], "warm_models": 1},
                  "disc": {"url": "http://127.0.0.1:2", "models": "discover"}},
        "routes": {"llm": {"path": "/v1", "kind": "openai", "nodes": ["box", "disc"], "max_swap_bypass": 4}},
    }))
    r = kl("check", "-c", str(good))
    assert r.returncode == 0 and r.stdout.startswith("ok:"), r.stdout + r.stderr
