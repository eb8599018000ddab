"""Damaged `.ninfer` files: every problem is one `ArtifactError` naming the file and the fault.

Truncation at every section boundary, seeded bit flips (prelude/header: open fails;
payload: `verify()` fails), and hand-made headers (re-checksummed, so the semantic checks
are what catch them) for each rule of `docs/artifact-format.md`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ninfer_core.artifact.layout import MAGIC, PRELUDE_BYTES, align_up
from ninfer_core.artifact.reader import open_container
from ninfer_core.artifact.writer import ContainerWriter
from ninfer_core.errors import ArtifactError


def make(tmp_path: Path, version: int = 3, volume_limit: int | None = None) -> Path:
    """config.json, then fp32 [100] (400 bytes), bf16 [8, 8], Q4G64 [2, 64], fp16 [300].
    With `volume_limit=700` a v3 file has three volumes: {config, a}, {b, q}, {c}."""
    path = tmp_path / "m.ninfer"
    kwargs: dict[str, Any] = {"volume_limit": volume_limit} if volume_limit else {}
    g = torch.Generator().manual_seed(0)
    with ContainerWriter(path, version=version, **kwargs) as w:
        w.add_resource("config.json", '{"architectures": ["Qwen3ForCausalLM"]}')
        w.add_tensor("a", "fp32", (100,), torch.randn(100, generator=g))
        w.add_tensor("b", "bf16", (8, 8), torch.randn(8, 8, generator=g).bfloat16())
        w.add_tensor("q", "Q4G64", (2, 64), torch.randint(0, 256, (68,), generator=g).byte())
        w.add_tensor("c", "fp16", (300,), torch.randn(300, generator=g).half())
    return path


def split(data: bytes) -> tuple[int, bytes, dict[str, Any], bytes]:
    """(version, artifact id bytes, header, payload of volume 0) of a sound file."""
    version = data[7]
    prelude = PRELUDE_BYTES[version]
    (length,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[prelude : prelude + length])
    return version, data[16:prelude], header, data[align_up(prelude + length + 32, 4096) :]


def assemble(version: int, artifact_id: bytes, raw: bytes, payload: bytes) -> bytes:
    """A file with header bytes `raw` and a correct checksum and padding."""
    prelude = MAGIC + bytes([version]) + struct.pack("<Q", len(raw)) + artifact_id
    head = prelude + raw + hashlib.sha256(prelude + raw).digest()
    return head + bytes(align_up(len(head), 4096) - len(head)) + payload


def rewrite(path: Path, mutate: Callable[[dict[str, Any]], Any]) -> None:
    version, aid, header, payload = split(path.read_bytes())
    replaced = mutate(header)
    header = header if replaced is None else replaced
    path.write_bytes(assemble(version, aid, json.dumps(header).encode(), payload))


def forge(path: Path, raw: bytes, version: int = 1) -> None:
    """A file whose header bytes are exactly `raw` (checksum correct)."""
    path.write_bytes(assemble(version, bytes(16) if version == 3 else b"", raw, b""))


def refused(path: Path, match: str, **kwargs) -> str:
    with pytest.raises(ArtifactError, match=match) as info:
        open_container(path, **kwargs)
    message = str(info.value)
    assert path.name in message, message
    assert "\n" not in message
    return message


def sections(path: Path) -> tuple[int, int, int, list[dict[str, Any]]]:
    """(prelude length L, header length H, payload start P, volume-0 objects)."""
    data = path.read_bytes()
    version, _, header, _ = split(data)
    prelude = PRELUDE_BYTES[version]
    (length,) = struct.unpack("<Q", data[8:16])
    objects = [o for o in header["objects"] if o.get("volume", 0) == 0]
    return prelude, length, align_up(prelude + length + 32, 4096), objects


# --- truncation -------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2, 3])
def test_truncation_at_every_section_boundary(tmp_path, version):
    path = make(tmp_path, version, volume_limit=700 if version == 3 else None)
    good = path.read_bytes()
    prelude, length, start, objects = sections(path)
    end = prelude + length
    cuts = {0, 3, 6, 7, 8, 12, 15, 16, 24, prelude - 1, prelude, prelude + 1, end // 2 + 8}
    cuts |= {end - 1, end, end + 16, end + 31, end + 32, start - 1, start}
    for o in objects:
        cuts |= {start + o["offset"], start + o["offset"] + 1, start + o["offset"] + o["nbytes"]}
    for cut in sorted(c for c in cuts if 0 <= c < len(good)):
        path.write_bytes(good[:cut])
        if cut < prelude:
            refused(path, "truncated prelude")
        elif cut < start:
            refused(path, rf"header length {length} does not fit")
        else:
            first = next(o for o in objects if start + o["offset"] + o["nbytes"] > cut)
            refused(path, f"truncated: object '{first['name']}' at payload bytes")
    path.write_bytes(good + b"\0")
    refused(path, "1 trailing bytes after the last object")


def test_truncated_and_missing_volume_files(tmp_path):
    path = make(tmp_path, 3, volume_limit=700)
    header = split(path.read_bytes())[2]
    for k, vol in enumerate(header["volumes"], start=1):
        part = path.with_name(f"m.ninfer.{vol['name']}")
        good = part.read_bytes()
        assert len(good) == vol["nbytes"]
        objects = [o for o in header["objects"] if o["volume"] == k]
        cuts = {0, len(good) - 1}
        for o in objects:
            cuts |= {o["offset"], o["offset"] + 1, o["offset"] + o["nbytes"]}
        for cut in sorted(c for c in cuts if c < len(good)):
            part.write_bytes(good[:cut])
            first = next(o for o in objects if o["offset"] + o["nbytes"] > cut)
            refused(path, f"{part.name}: truncated: object '{first['name']}'")
        part.write_bytes(good + b"xx")
        refused(path, f"{part.name}: 2 trailing bytes")
        part.unlink()
        refused(path, f"missing volume file {re.escape(part.name)} \\(volume {k} of 2\\)")
        part.write_bytes(good)
    assert open_container(path).verify() == []


# --- bit flips --------------------------------------------------------------------------

HEAD_DAMAGE = (
    "not a .ninfer file|container version|does not fit|truncated prelude"
    "|header checksum mismatch|nonzero byte in the padding"
)


@pytest.mark.parametrize("version", [1, 3])
def test_bit_flips_in_prelude_and_header_fail_at_open(tmp_path, version):
    path = make(tmp_path, version)
    good = path.read_bytes()
    start = sections(path)[2]
    rng = random.Random(1234 + version)
    positions = [*range(16), *(rng.randrange(start) for _ in range(150))]
    for pos in positions:
        bad = bytearray(good)
        bad[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(bad))
        refused(path, HEAD_DAMAGE)


def test_bit_flips_in_the_payload_fail_verify(tmp_path):
    path = make(tmp_path, 3, volume_limit=700)
    header = split(path.read_bytes())[2]
    start = sections(path)[2]
    files = [path] + [path.with_name(f"m.ninfer.{v['name']}") for v in header["volumes"]]
    rng = random.Random(99)
    for _ in range(120):
        k = rng.randrange(len(files))
        base = start if k == 0 else 0
        good = files[k].read_bytes()
        pos = rng.randrange(base, len(good))
        bad = bytearray(good)
        bad[pos] ^= 1 << rng.randrange(8)
        files[k].write_bytes(bytes(bad))
        problems = open_container(path).verify()  # sizes and header intact: opens
        hit = [o for o in header["objects"] if o["volume"] == k]
        hit = [o for o in hit if o["offset"] <= pos - base < o["offset"] + o["nbytes"]]
        assert len(problems) == 1, problems
        assert files[k].name in problems[0]
        if hit:
            assert f"object '{hit[0]['name']}'" in problems[0] and "corrupt" in problems[0]
        else:
            assert "nonzero bytes in the alignment gap" in problems[0]
        files[k].write_bytes(good)
    assert open_container(path).verify() == []


# --- the prelude ------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 4, 255])
def test_unknown_version(tmp_path, version):
    path = make(tmp_path)
    data = bytearray(path.read_bytes())
    data[7] = version
    path.write_bytes(bytes(data))
    refused(
        path, f"m.ninfer: .ninfer container version {version}; this build reads versions 1, 2, 3"
    )


@pytest.mark.parametrize("head", [b"GGUF\x03\x00\x00\x00", b"ninfer\x00\x03", b"PK\x03"])
def test_wrong_magic(tmp_path, head):
    path = make(tmp_path)
    path.write_bytes(head + path.read_bytes()[len(head) :])
    refused(path, re.escape(f"not a .ninfer file: it starts with {path.read_bytes()[:8]!r}"))


def test_header_length_claiming_2_to_the_60(tmp_path):
    path = make(tmp_path)
    data = bytearray(path.read_bytes())
    data[8:16] = struct.pack("<Q", 2**60)
    path.write_bytes(bytes(data))
    refused(path, f"header length {2**60} does not fit")


def test_header_longer_than_the_cap_is_refused_before_reading(tmp_path):
    path = tmp_path / "m.ninfer"
    with path.open("wb") as fh:  # a sparse 80 MiB file: the length fits, but is absurd
        fh.write(MAGIC + b"\x01" + struct.pack("<Q", 70 << 20))
        fh.truncate(80 << 20)
    refused(path, "does not fit.*the limit is 67108864")


def test_a_directory_is_not_a_container(tmp_path):
    (tmp_path / "d.ninfer").mkdir()
    refused(tmp_path / "d.ninfer", "cannot read")


# --- the header bytes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b'{"format_version": 1, "objects": [], "x": "\xff\xfe"}', "header is not valid UTF-8"),
        (b"[1, 2, 3]", "header JSON is a list, not an object"),
        (b'"text"', "header JSON is a string, not an object"),
        (b"{not json", "header is not valid JSON"),
        (b"", "header is not valid JSON"),
        (b'{"format_version": 1, "format_version": 1, "objects": []}', "appears twice"),
        (b'{"format_version": NaN, "objects": []}', "non-standard JSON constant NaN"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"format_version": 1' + b"0" * 5000 + b', "objects": []}', "not valid JSON"),
        (b'{"objects": []}', "header lacks 'format_version'"),
        (b'{"format_version": 1, "objects": [], "identity": null}', "unknown key 'identity'"),
        (b'{"format_version": 2, "objects": []}', "format_version 2 differs from the prel"),
        (b'{"format_version": true, "objects": []}', "must be an integer, not a boolean"),
        (b'{"format_version": 1, "objects": {}}', "objects must be a list, not an object"),
        (b'{"format_version": 1, "objects": [7]}', "object 0 must be an object, not an int"),
    ],
)
def test_bad_header_bytes(tmp_path, raw, match):
    forge(tmp_path / "m.ninfer", raw)
    refused(tmp_path / "m.ninfer", match)


def test_an_empty_container_opens(tmp_path):
    forge(tmp_path / "m.ninfer", b'{"format_version": 1, "objects": []}')
    art = open_container(tmp_path / "m.ninfer")
    assert art.tensor_names() == [] and art.verify() == []


# --- objects ----------------------------------------------------------------------------


def obj(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda h: next(o for o in h["objects"] if o["name"] == name)


def setter(target: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: obj(target)(h).update(fields)


def _delete(target: str, key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(h):
        del obj(target)(h)[key]

    return mutate


def _duplicate(h):
    h["objects"][2]["name"] = "a"


def _overlap(h):
    b = obj("b")(h)
    b["offset"] = obj("a")(h)["offset"] + 256  # inside a's 400 bytes


def _swap(h):
    objs = h["objects"]
    objs[1], objs[2] = objs[2], objs[1]


def _past_the_end(h):
    c = obj("c")(h)
    c["offset"] += 1 << 30


CASES = {
    "overlap": (_overlap, r"object 'b' at bytes \[512, 640\) overlaps 'a' at \[256, 656\)"),
    "order": (
        _swap,
        "'a' at offset 256 is listed after 'b' at offset 768: objects must be in offset order",
    ),
    "misaligned": (setter("b", offset=776), "offset 776 is misaligned"),
    "negative offset": (setter("b", offset=-256), "offset is -256; it must be at least 0"),
    "offset string": (setter("b", offset="768"), "offset must be an integer, not a string"),
    "offset float": (setter("b", offset=768.0), "offset must be an integer, not a number"),
    "nbytes bool": (setter("b", nbytes=True), "nbytes must be an integer, not a boolean"),
    "nbytes mismatch": (
        setter("b", nbytes=256),
        r"'b' nbytes 256 does not match its shape \[8, 8\] in bf16, which takes 128 bytes",
    ),
    "huge dims": (
        setter("a", shape=[2**40, 2**40]),
        "has 1208925819614629174706176 elements, more than 2\\*\\*48 \\(absurd dimensions\\)",
    ),
    "huge dim": (setter("a", shape=[2**60, 0]), "dimension 1152921504606846976 outside"),
    "negative dim": (setter("a", shape=[-4, -100]), "dimension -4 outside"),
    "dim bool": (setter("a", shape=[True]), "dimension that is a boolean"),
    "many dims": (setter("a", shape=[1] * 9), "9 dimensions, more than 8"),
    "shape not a list": (setter("a", shape=100), "shape must be a list"),
    "unknown format": (
        setter("a", format="Q3G64"),
        "unknown weight format 'Q3G64'; known formats: fp32, fp16, bf16, Q4G64, Q5G64",
    ),
    "quantized 1-D": (setter("q", shape=[128]), "format Q4G64 stores 2-D"),
    "duplicate name": (_duplicate, "duplicate object name 'a'"),
    "empty name": (setter("a", name=""), "1 to 1024 characters"),
    "bad kind": (setter("a", kind="blob"), "kind 'blob'; expected 'tensor' or 'resource'"),
    "unknown key": (setter("a", dtype="F32"), "object 'a' has unknown key 'dtype'"),
    "missing key": (_delete("a", "sha256"), "object 'a' lacks 'sha256'"),
    "bad sha256": (setter("a", sha256="00"), "sha256 must be 64 lowercase hex digits"),
    "past the end": (_past_the_end, "truncated: object 'c'"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_objects(tmp_path, case):
    mutate, match = CASES[case]
    path = make(tmp_path, version=1)
    rewrite(path, mutate)
    refused(path, match)


# --- version 2 and 3 fields --------------------------------------------------------------


def _top(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: h.update(fields)


def _volume(k: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: h["volumes"][k].update(fields)


V3_CASES = {
    "identity type": (_top(identity="me"), "identity must be an object"),
    "identity keys": (_top(identity={"model_id": "m"}), "exactly the keys model_id"),
    "identity value": (
        _top(identity={"model_id": 1, "weights_id": "w"}),
        "identity.model_id must be a string",
    ),
    "recipe type": (_top(recipe=[1]), "recipe must be a JSON object, not a list"),
    "artifact id differs": (_top(artifact_id="0" * 32), "artifact_id 0{32} differs"),
    "artifact id form": (_top(artifact_id="XYZ"), "artifact_id must be 32 lowercase hex"),
    "volume name": (_volume(0, name="../../etc/passwd"), "it must be 'part-0001'"),
    "volume size": (_volume(1, nbytes=4096), "volume part-0002 is declared as 4096 bytes"),
    "volume index": (setter("c", volume=5), "in volume 5, but the header lists 2"),
    "volume order": (setter("b", volume=0), "overlaps 'a'|offset order"),
    "volumes type": (_top(volumes={}), "volumes must be a list"),
    "component unlisted": (setter("b", component="vision"), "component 'vision', which the"),
    "component name": (
        _top(components=[{"name": "Text!", "description": ""}]),
        "component name 'Text!' must match",
    ),
    "component duplicate": (
        _top(components=[{"name": "text", "description": ""}] * 2),
        "duplicate component name 'text'",
    ),
    "resource component": (setter("config.json", component="text"), "unknown key 'component'"),
    "tensor lacks volume": (_delete("a", "volume"), "object 'a' lacks 'volume'"),
}


@pytest.mark.parametrize("case", V3_CASES)
def test_bad_v3_fields(tmp_path, case):
    mutate, match = V3_CASES[case]
    path = make(tmp_path, version=3, volume_limit=700)
    rewrite(path, mutate)
    refused(path, match)


def test_v2_header_with_v3_fields(tmp_path):
    path = make(tmp_path, version=2)
    rewrite(path, _top(volumes=[]))
    refused(path, "header has unknown key 'volumes'")


# --- random header mutations ------------------------------------------------------------

ODD_VALUES = [None, True, -1, 0, 255, 256, 2**64, -(2**63), 1.5, "", "text", "Q4G64",
              [], [2**40, 2**40], {}, {"a": 1}, "part-0001"]  # fmt: skip


def _paths(doc: Any, at: tuple = ()) -> list[tuple]:
    found = [at]
    items = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    )
    for key, value in items:
        found += _paths(value, (*at, key))
    return found


@pytest.mark.parametrize("version", [1, 2, 3])
def test_random_header_mutations_fail_cleanly(tmp_path, version):
    """Re-checksummed headers with values replaced or keys dropped: each either opens (and
    verifies) or is one ArtifactError naming the file, by a rule, never the safety net."""
    path = make(tmp_path, version, volume_limit=700 if version == 3 else None)
    v, aid, header, payload = split(path.read_bytes())
    rng = random.Random(version)
    for _ in range(300):
        doc = json.loads(json.dumps(header))
        for _ in range(rng.randint(1, 3)):
            at = rng.choice(_paths(doc)[1:])
            parent = doc
            for key in at[:-1]:
                parent = parent[key]
            if rng.random() < 0.8:
                parent[at[-1]] = rng.choice(ODD_VALUES)
            else:
                del parent[at[-1]]
        path.write_bytes(assemble(v, aid, json.dumps(doc).encode(), payload))
        try:
            art = open_container(path)
        except ArtifactError as exc:
            assert path.name in str(exc) and "malformed header" not in str(exc), exc
        else:
            assert isinstance(art.verify(), list)
