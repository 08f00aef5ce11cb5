"""The route's directory of ComfyUI files (comfy_files.py) and the SigV4 signer (wire/s3.py), without sockets."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

from kilolined.adapters.comfy_files import RouteFiles, annotated, clean_subfolder, may_read
from kilolined.adapters.comfy_inputs import decode_data_url, fetch_allowed
from kilolined.wire.s3 import EMPTY_SHA256, sign


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_nodes_name_is_kept_while_unique_else_numbered_as_comfyui_does() -> None:
    files = RouteFiles(Clock())
    assert files.route_filename("a", "ComfyUI_00001_.png", "") == "ComfyUI_00001_.png"
    # b numbers its own outputs from 1 too: the route's next free counter, as SaveImage counts.
    assert files.route_filename("b", "ComfyUI_00001_.png", "") == "ComfyUI_00002_.png"
    assert files.route_filename("a", "ComfyUI_00002_.png", "") == "ComfyUI_00003_.png"
    assert files.route_filename("b", "ComfyUI_00003_.png", "") == "ComfyUI_00004_.png"
    # The same node file keeps its name (executed, then history); other folders are other names.
    assert files.route_filename("b", "ComfyUI_00001_.png", "") == "ComfyUI_00002_.png"
    assert files.route_filename("b", "ComfyUI_00001_.png", "x") == "ComfyUI_00001_.png"
    # A name without SaveImage's counter: ComfyUI's upload renaming.
    assert files.route_filename("a", "clip.mp4", "") == "clip.mp4"
    assert files.route_filename("b", "clip.mp4", "") == "clip (1).mp4"
    # Previews have names of their own.
    assert files.route_filename("b", "clip.mp4", "", kind="temp") == "clip.mp4"


def test_uploads_are_renamed_on_a_clash_and_bounded() -> None:
    clock = Clock()
    files = RouteFiles(clock, max_bytes=10, ttl=60)
    assert files.upload("input", "", "cat.png", b"1234", "alice", False).name == "cat.png"
    assert files.upload("input", "", "cat.png", b"1234", "bob", False).owners == {"alice", "bob"}
    assert files.upload("input", "", "cat.png", b"5678", "bob", False).name == "cat (1).png"
    assert files.held().bytes == 8
    # Over max_bytes: the least recently used goes first (cat.png; cat (1).png was used last).
    files.upload("input", "", "dog.png", b"abcd", "bob", False)
    assert files.get("input", "", "cat.png") is None
    assert files.get("input", "", "cat (1).png") is not None
    assert files.held().bytes == 8
    # Unused for the TTL: forgotten.
    clock.t += 61
    assert files.held().files == 0 and files.held().bytes == 0


def test_a_key_overwrites_only_its_own_files() -> None:
    files = RouteFiles(Clock())
    files.upload("input", "", "cat.png", b"alice's", "alice", False)
    assert files.upload("input", "", "cat.png", b"bob's", "bob", True).name == "cat (1).png"
    assert files.get("input", "", "cat.png").data == b"alice's"  # type: ignore[union-attr]
    assert files.upload("input", "", "cat.png", b"alice's 2", "alice", True).name == "cat.png"
    assert files.upload("input", "", "cat.png", b"bob's 2", "bob", True, shared=True).name == "cat.png"


def test_a_file_used_lives_on_and_an_unknown_owner_reads_nothing() -> None:
    clock = Clock()
    files = RouteFiles(clock, ttl=60)
    f = files.upload("input", "", "cat.png", b"1", "alice", False)
    clock.t += 50
    files.use(f)
    clock.t += 50
    assert files.get("input", "", "cat.png") is f
    assert may_read(f, "alice", False, False) and not may_read(f, "bob", False, False)
    assert may_read(f, "bob", True, False) and may_read(f, "bob", False, True)


def test_content_named_inputs_and_values() -> None:
    files = RouteFiles(Clock())
    one = files.content(b"png", ".png", "alice")
    assert one.name == f"kl_{hashlib.sha256(b'png').hexdigest()[:32]}.png"
    assert files.content(b"png", ".png", "bob") is one and one.owners == {"alice", "bob"}
    assert annotated("sub/dir/cat.png") == ("input", "sub/dir", "cat.png")
    assert annotated("ComfyUI_00001_.png [output]") == ("output", "", "ComfyUI_00001_.png")
    assert clean_subfolder("../x") is None and clean_subfolder("/x") is None and clean_subfolder("a//b/") == "a/b"
    assert decode_data_url("data:image/png;base64,cG5n") == (b"png", ".png")
    assert decode_data_url("data:text/plain,hello") is None


def test_fetch_inputs_globs_see_the_canonical_url() -> None:
    globs = ["https://cdn.example.com/*", "http://[::1]:8000/*"]
    assert fetch_allowed(globs, "https://cdn.example.com/a.png") == "https://cdn.example.com/a.png"
    assert fetch_allowed(globs, "http://[0:0::1]:8000/a.png") == "http://[::1]:8000/a.png"
    assert fetch_allowed(globs, "https://cdn.example.com@evil.example/a.png") is None
    assert fetch_allowed(globs, "https://cdn.example.com.evil.example/a.png") is None
    assert fetch_allowed([], "https://cdn.example.com/a.png") is None


# The two worked examples of the AWS documentation ("Signature Calculations for the Authorization
# Header: Transferring Payload in a Single Chunk", SigV4 for S3).
AKID, SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
WHEN = datetime(2013, 5, 24, tzinfo=UTC)


def test_sigv4_get_object_example() -> None:
    h = sign("GET", "https://examplebucket.s3.amazonaws.com/test.txt", {"Range": "bytes=0-9"}, EMPTY_SHA256,
             AKID, SECRET, "us-east-1", WHEN)
    assert h["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


def test_sigv4_put_object_example() -> None:
    h = sign("PUT", "https://examplebucket.s3.amazonaws.com/test%24file.text",
             {"Date": "Fri, 24 May 2013 00:00:00 GMT", "x-amz-storage-class": "REDUCED_REDUNDANCY"},
             hashlib.sha256(b"Welcome to Amazon S3.").hexdigest(), AKID, SECRET, "us-east-1", WHEN)
    assert h["Authorization"].endswith("Signature=98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd")
