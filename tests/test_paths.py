"""kilolined.core.paths: the raw-path check, as a pure function (the wire-level tests are in test_hostile)."""

from __future__ import annotations

import pytest

from kilolined.core.paths import path_of_target, path_problem


@pytest.mark.parametrize("raw", [
    "/a/../b", "/a/./b", "/..", "/.", "/a/..", "/a/%2e%2e/b", "/a/%2E%2E/b", "/a/.%2e/b", "/a/..%2f..%2fb",
    "/a/..%2F..%2Fb", "/a/x%5c..%5cy", "/a/x%5C.%5Cy", "/a\\..\\b", "/a/%2f..%2f", "/a/%2e",
])
def test_dot_parts_are_refused(raw: str) -> None:
    assert path_problem(raw) == "the path holds a '.' or '..' segment"


@pytest.mark.parametrize("raw", ["/a\x00b", "/a/%00", "/a/b%00.png"])
def test_nul_is_refused(raw: str) -> None:
    assert path_problem(raw) == "the path holds a NUL byte"


@pytest.mark.parametrize("raw", [
    "/", "", "/v1/models/org%2Fmodel", "/models/meta-llama%2FLlama-3.1-8B", "/.well-known/acme", "/a..b", "/a/...",
    "/file.tar.gz", "/a/%2e%2e%2e", "/a//b", "/%252e%252e/x",  # double-encoded: one decode leaves %2e%2e, data
    "/caf%C3%A9", "/%FF",
])
def test_everything_else_passes(raw: str) -> None:
    assert path_problem(raw) is None


@pytest.mark.parametrize(("target", "path"), [
    ("/a/b?x=../..", "/a/b"), ("/a#frag", "/a"), ("http://host:80/a/../b?q", "/a/../b"), ("https://h", ""),
    ("/a?b#c", "/a"), ("*", "*"),
])
def test_path_of_target(target: str, path: str) -> None:
    assert path_of_target(target) == path
