"""The wire formats as the docs state them are the codec's own: every frame size in
docs/*.md, and every field layout in docs/API.md's table, is checked against the
structs in wire/grants.py, wire/frames.py and transport/rdma_wire.py. (A raw reader
builds its frames from these docs: a stale size there is a frame the slab refuses.)"""

from __future__ import annotations

import re

import pytest

from polarkv_lib.transport import rdma_wire
from polarkv_lib.wire import frames, grants
from tests.conftest import ROOT

SIZES = {
    "request header": frames.REQUEST_SIZE,
    "grant": grants.GRANT_SIZE,
    "signed grant body": grants.SIGNED_SIZE,
    "response header": frames.RESPONSE_SIZE,
    "rdma hello": rdma_wire.HELLO_SIZE,
    "rdma accept": rdma_wire.ACCEPT_SIZE,
    "rdma window answer": rdma_wire.WINDOW_SIZE,
}
# "a 64-byte request", "a 12-byte response", "a 64-byte hello" in prose
PROSE = {
    "request": frames.REQUEST_SIZE,
    "grant": grants.GRANT_SIZE,
    "response": frames.RESPONSE_SIZE,
    "hello": rdma_wire.HELLO_SIZE,
    "accept": rdma_wire.ACCEPT_SIZE,
}
WIDTHS = {"u8": 1, "u16": 2, "u32": 4, "u64": 8}
TYPE = re.compile(r"(?<![\w-])(u8|u16|u32|u64|\d+[sx])(?![\w-])")


def _width(field: str) -> int:
    """The bytes one `name type (note)` field of a layout takes."""
    field = re.sub(r"\([^)]*\)|`[^`]*`", " ", field)  # notes and quoted magic values
    types = TYPE.findall(field)
    assert len(types) == 1, f"one type per field, got {types} in {field!r}"
    code = types[0]
    return WIDTHS[code] if code in WIDTHS else int(code[:-1])


def frame_table() -> dict[str, tuple[int, list[str]]]:
    """docs/API.md's frame table: name -> (stated size, fields of its layout)."""
    rows: dict[str, tuple[int, list[str]]] = {}
    for line in (ROOT / "docs" / "API.md").read_text().splitlines():
        m = re.fullmatch(r"\| ([a-z ]+) \| (\d+) bytes \| (.+) \|", line)
        if m:
            rows[m.group(1)] = (int(m.group(2)), m.group(3).split(" · "))
    return rows


def test_every_frame_is_in_the_table() -> None:
    assert set(frame_table()) == set(SIZES)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_stated_size_and_layout_match_the_struct(name: str) -> None:
    stated, fields = frame_table()[name]
    assert stated == SIZES[name], f"docs/API.md says a {name} is {stated} bytes"
    assert sum(_width(f) for f in fields) == SIZES[name], f"{name} layout: {fields}"


def test_sizes_in_prose_match_the_structs() -> None:
    found = 0
    for path in sorted((ROOT / "docs").glob("*.md")):
        text = path.read_text()
        for m in re.finditer(
            r"\b(\d+)-byte (?:rdma )?(request|grant|response|hello|accept)\b", text
        ):
            found += 1
            size, what = int(m.group(1)), m.group(2)
            assert size == PROSE[what], f"{path.name}: '{m.group(0)}', the code's is {PROSE[what]}"
        for m in re.finditer(r"\bgrant \((\d+) bytes\)", text):
            assert int(m.group(1)) == grants.GRANT_SIZE, f"{path.name}: '{m.group(0)}'"
        for m in re.finditer(r"HMAC-SHA256\(grant_key, first (\d+) bytes\)", text):
            assert int(m.group(1)) == grants.SIGNED_SIZE, f"{path.name}: '{m.group(0)}'"
    assert found >= 3  # ARCHITECTURE.md's request and response, RDMA.md's hello
