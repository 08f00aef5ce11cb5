"""docs/API.md "The APIs clients speak": every example there (curl and the official SDKs) runs as
written against a gateway over the simulated llama.cpp server (its route with the alias of the
section's own config), with `http://gateway:8080` the test gateway's URL and `$KEY` a client key."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from comfy_workflows import INVERT, TXT2IMG, TXT2IMG_INPUTS
from conftest import KEYS, base_config

from kilolined.fakegpu.comfy_graph import make_png

API_MD = Path(__file__).resolve().parent.parent / "docs" / "API.md"
SECTION = "## The APIs clients speak"


def examples() -> list[tuple[str, str]]:
    """(language, code) of each sh/python fenced block of the section, in order."""
    text = API_MD.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    body = text[start:end if end > 0 else None]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(sh|python)\n(.*?)^```$", body, re.S | re.M)]


def test_the_section_has_curl_and_sdk_examples_for_each_api() -> None:
    found = examples()
    assert [lang for lang, _ in found].count("python") >= 2 and [lang for lang, _ in found].count("sh") >= 3
    joined = "\n".join(code for _, code in found)
    for what in ("/v1/messages", "anthropic.Anthropic", "/v1/audio/transcriptions", "audio.transcriptions", "/health",
                 '"model": "gpt-4o-mini"', 'model="gpt-4o-mini"', "models.list()", "/v1/images/generations",
                 "/v1/images/edits", "images.generate", "images.edit"):
        assert what in joined, what


@pytest.mark.parametrize("index", range(len(examples())))
async def test_example_runs_against_the_gateway(index: int, fakegpus: Any, gateway: Any, tmp_path: Path) -> None:
    lang, code = examples()[index]
    fake = await fakegpus("openai", step_ms=1)
    cfg = base_config({"o": fake.url}, kind="openai", path="/v1", rewrite={"model": {"gpt-4o-mini": "qwen2.5-7b"}})
    cfg["nodes"]["o"]["models"] = ["qwen2.5-7b", "whisper-1"]  # the fake takes any: the gateway routes by these
    # The images section's route: a fake ComfyUI with the section's two templates.
    comfy = await fakegpus("comfyui", steps=1, step_ms=1)
    cfg["nodes"]["c"] = {"url": comfy.url}
    (tmp_path / "txt2img.json").write_text(json.dumps(TXT2IMG))
    (tmp_path / "invert.json").write_text(json.dumps(INVERT))
    cfg["routes"]["comfy"] = {"path": "/comfy", "kind": "comfyui", "nodes": ["c"], "templates": {
        "sd15": {"workflow": str(tmp_path / "txt2img.json"), "inputs": TXT2IMG_INPUTS},
        "invert": {"workflow": str(tmp_path / "invert.json"), "inputs": {"image": "10.inputs.image"}}}}
    gw = await gateway(cfg)
    (tmp_path / "photo.png").write_bytes(make_png("photo"))
    (tmp_path / "speech.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(64))
    code = code.replace("http://gateway:8080", gw.url)
    argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "sh" else [sys.executable, "-c", code]
    proc = await asyncio.create_subprocess_exec(*argv, cwd=tmp_path, env={**os.environ, "KEY": KEYS["alice"]},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, (code, out.decode(), err.decode())
    text = out.decode()
    assert text.strip(), code
    if "/images/" in code:
        assert text.count('"url":') == 1 and '"b64_json":' in text
    if "images.generate" in code:
        assert all((tmp_path / f"fox{i}.png").read_bytes().startswith(b"\x89PNG") for i in (0, 1))
        assert gw.url + "/comfy/view?filename=" in text
    if "/health" in code:
        assert text.strip() == "200"
    if "/v1/messages" in code:
        assert '"type":"message"' in text.replace(" ", "")
    if "anthropic" in code:
        assert text.rstrip().endswith("authentication_error")
    if "gpt-4o-mini" in code:  # the alias: the node is sent the served name, the client sees its own
        sent = fake.backend.bodies  # type: ignore[attr-defined]
        assert sent and {b["model"] for b in sent} == {"qwen2.5-7b"}
        assert "qwen2.5-7b" in text and text.count("gpt-4o-mini") >= 2
        assert '"model":"qwen2.5-7b"' not in text.replace(" ", "") and "qwen2.5-7b " not in text
