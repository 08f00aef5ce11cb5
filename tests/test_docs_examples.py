"""docs/API.md's runnable examples, run as a reader would run them: each block marked
``<!-- runnable -->`` (curl in ``sh``, the official ``openai`` SDK in ``python``) against a live
gateway over fake GPUs, with only the base URL and the key substituted. An example that no longer
works fails here."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import KEYS, base_config

API = Path(__file__).resolve().parents[1] / "docs" / "API.md"
DOC_BASE = "http://localhost:8080"
RUNNABLE = re.compile(r"^<!-- runnable -->\n```(sh|python)\n(.*?)^```", re.S | re.M)


def runnable_blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in RUNNABLE.finditer(API.read_text())]


def test_api_md_has_runnable_curl_and_sdk_examples() -> None:
    langs = [lang for lang, _ in runnable_blocks()]
    assert langs.count("sh") >= 2 and "python" in langs, langs


async def run_block(lang: str, code: str, base: str) -> tuple[int, str]:
    code = code.replace(DOC_BASE, base)
    env = {**os.environ, "KILOLINE_KEY": KEYS["alice"]}
    args = ["bash", "-euo", "pipefail", "-c", code] if lang == "sh" else [sys.executable, "-c", code]
    proc = await asyncio.create_subprocess_exec(*args, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(errors="replace")


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
async def test_each_runnable_example_works_against_a_gateway(fakegpus: Any, gateway: Any, index: int) -> None:
    llm = await fakegpus("openai")
    tts = await fakegpus()
    cfg = base_config({"tts-box": tts.url})
    cfg["nodes"]["llm-box"] = {"url": llm.url}
    cfg["routes"] = {"tts": {"path": "/tts", "nodes": ["tts-box"], "queue_timeout_sec": 30},
                     "llm": {"path": "/v1", "kind": "openai", "nodes": ["llm-box"], "queue_timeout_sec": 30}}
    gw = await gateway(cfg)
    lang, code = runnable_blocks()[index]
    status, out = await run_block(lang, code, gw.url)
    assert status == 0, out
    assert out.strip(), "the example printed nothing"
    assert '"error":{' not in out.replace(" ", ""), out  # no gateway or node error on the way
