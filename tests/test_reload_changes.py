"""The reload log line, and /admin/state, say what a reload changed (issue 21): which routes,
nodes and keys were added, removed or changed — key ids only, never key material."""

from __future__ import annotations

import copy
import logging
from typing import Any

import aiohttp
import pytest
import yaml
from conftest import ADMIN_KEY, KEYS, base_config, sha
from reload_admin import admin_reload, admin_state

DAVE = "kl_dave_key_changes_00000000000000000"


def applied_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "✓ [reload] config" in r.getMessage()]


async def test_the_reload_line_names_what_changed(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    g = await fakegpus(steps=0)
    cfg = base_config({"a": g.url, "b": g.url})
    cfg["routes"]["img"] = {"path": "/img", "nodes": ["a"]}
    gw = await gateway(cfg)
    caplog.set_level(logging.INFO, logger="kilolined")

    new = copy.deepcopy(cfg)
    new["server"]["listen"] = gw.rt.cfg.server.listen
    new["routes"]["tts"] = {"path": "/tts", "nodes": ["c"]}  # added, on a node added
    new["routes"]["gen"]["max_concurrency"] = 5  # changed
    new["routes"]["gen"]["standby"] = []
    del new["routes"]["img"]  # removed
    new["nodes"]["c"] = {"url": g.url}
    del new["nodes"]["b"]
    new["keys"]["dave"] = {"key_sha256": sha(DAVE), "routes": ["*"]}
    del new["keys"]["bob"]
    new["keys"]["carol"]["routes"] = ["gen"]
    new["jobs"] = {"result_ttl_sec": 60}
    gw.path.write_text(yaml.safe_dump(new))
    status, _ = await admin_reload(http, gw.url)
    assert status == 200

    [line] = applied_lines(caplog)
    assert line.endswith(": routes +tts -img ~gen; nodes +c -b; keys +dave -bob ~carol; ~jobs"), line
    everything = caplog.text
    for secret in [*KEYS.values(), DAVE, ADMIN_KEY]:
        assert secret not in everything and sha(secret) not in everything

    changes = (await admin_state(http, gw.url))["config"]["changes"]
    assert changes == {
        "routes": {"added": ["tts"], "removed": ["img"], "changed": ["gen"]},
        "nodes": {"added": ["c"], "removed": ["b"], "changed": []},
        "keys": {"added": ["dave"], "removed": ["bob"], "changed": ["carol"]},
        "sections": ["jobs"],
    }

    # A comment, or a value written out that equals its default: nothing changed, and it says so.
    caplog.clear()
    new["routes"]["gen"]["queue_timeout_sec"] = gw.rt.cfg.routes["gen"].queue_timeout_sec
    gw.path.write_text(yaml.safe_dump(new) + "# reviewed\n")
    status, _ = await admin_reload(http, gw.url)
    assert status == 200
    [line] = applied_lines(caplog)
    assert line.endswith(": no setting changed (comments or layout only)"), line
    assert (await admin_state(http, gw.url))["config"]["changes"]["routes"]["changed"] == []
