"""/metrics beyond the request families: the process, the build, whether the running config is
the file; and no dependency the package does not import. Scraped over a real socket."""

from __future__ import annotations

import ast
import configparser
import re
import time
from pathlib import Path
from typing import Any

import yaml
from conftest import ADMIN, base_config
from prometheus_client.parser import text_string_to_metric_families

from kilolined import __version__

ROOT = Path(__file__).resolve().parent.parent
# distribution name -> the module it installs, where the two differ
IMPORT_NAME = {"pyyaml": "yaml", "prometheus-client": "prometheus_client"}
# Listed for another package, not imported by ours: why each is there.
FOR_OTHERS = {"async-timeout": "redis-py imports it on Python < 3.11.3 (Debian 12's python3 is 3.11.2)"}


async def scrape(http, gw) -> dict[str, Any]:
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        assert r.status == 200
        text = await r.text()
    return {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}


async def test_process_platform_and_gc_collectors(fakegpus, gateway, http) -> None:
    gw = await gateway(base_config({"a": (await fakegpus()).url}))
    samples = await scrape(http, gw)
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_virtual_memory_bytes",
                 "process_start_time_seconds", "process_open_fds", "process_max_fds"):
        assert name in samples, name
    assert samples["process_resident_memory_bytes"].value > 0
    assert samples["process_start_time_seconds"].value <= time.time()
    assert samples["python_info"].labels["implementation"] == "CPython"
    assert "python_gc_collections_total" in samples


async def test_build_info_carries_the_package_version(fakegpus, gateway, http) -> None:
    gw = await gateway(base_config({"a": (await fakegpus()).url}))
    samples = await scrape(http, gw)
    info = samples["kiloline_build_info"]
    assert info.labels == {"version": __version__} and info.value == 1


async def test_config_reload_gauges_follow_the_last_reload(fakegpus, gateway, http) -> None:
    cfg = base_config({"a": (await fakegpus()).url})
    before = time.time()
    gw = await gateway(cfg)
    samples = await scrape(http, gw)
    assert samples["kiloline_config_last_reload_successful"].value == 1
    loaded = samples["kiloline_config_last_reload_success_timestamp_seconds"].value
    assert before <= loaded <= time.time()

    gw.path.write_text(yaml.safe_dump(cfg).replace("max_concurrency: 2", "max_concurrency: -1"))
    async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
        assert r.status == 422
    samples = await scrape(http, gw)
    assert samples["kiloline_config_last_reload_successful"].value == 0
    assert samples["kiloline_config_last_reload_success_timestamp_seconds"].value == loaded  # still the old one

    cfg["routes"]["gen"]["max_concurrency"] = 3
    before = time.time()
    gw.write_config(cfg)
    async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
        assert r.status == 200
    samples = await scrape(http, gw)
    assert samples["kiloline_config_last_reload_successful"].value == 1
    assert before <= samples["kiloline_config_last_reload_success_timestamp_seconds"].value <= time.time()


def test_every_install_requirement_is_imported() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    wanted = {re.split(r"[<>=;\s\[]", line.strip(), maxsplit=1)[0].lower()
              for line in cfg["options"]["install_requires"].splitlines() if line.strip()}
    imported: set[str] = set()
    for path in (ROOT / "kilolined").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    unused = {d for d in wanted - set(FOR_OTHERS) if IMPORT_NAME.get(d, d.replace("-", "_")) not in imported}
    assert not unused, f"install_requires lists what kilolined never imports: {sorted(unused)}"
