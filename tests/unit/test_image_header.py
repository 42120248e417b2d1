"""The image probe reads headers only: no pixel is decoded at any size, and a PNG's EXIF
orientation is the one PIL's full load finds, wherever in the file its chunk is."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image, ImageFile

from encdis.image_header import read_header


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        out.append((png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]))
        pos += 12 + length
    return out


def _png(chunks: list[tuple[bytes, bytes]]) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"".join(_chunk(k, p) for k, p in chunks)


def _plain_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


def _exif_payload(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def _with_chunk_after_idat(png: bytes, kind: bytes, payload: bytes) -> bytes:
    chunks = _chunks(png)
    return _png([*chunks[:-1], (kind, payload), chunks[-1]])  # just before IEND


def _fully_loaded_orientation(data: bytes) -> int:
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return int(image.getexif().get(0x0112, 1))


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every pixel decode PIL starts while the test runs."""
    seen: list[str] = []
    real = ImageFile.ImageFile.load

    def counting(self):
        seen.append(str(self.format))
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting)
    return seen


def test_probing_a_4000x4000_png_decodes_no_pixels(loads: list[str]) -> None:
    header = read_header(_plain_png(4000, 4000))
    assert (header.format, header.width, header.height, header.orientation) == ("PNG", 4000, 4000, 1)
    assert loads == []


def test_a_png_whose_pixel_data_is_garbage_still_probes() -> None:
    """Only a decode would notice the garbage: the probe never gets that far."""
    chunks = _chunks(_plain_png(8000, 8000))
    garbage = [(k, b"\x00not zlib" * 1000 if k == b"IDAT" else p) for k, p in chunks]
    data = _png(garbage)
    with pytest.raises(OSError, match="broken data stream"):
        _fully_loaded_orientation(data)
    header = read_header(data)
    assert (header.width, header.height, header.orientation) == (8000, 8000, 1)


@pytest.mark.parametrize("where", ["before_idat", "after_idat"])
def test_png_exif_orientation_is_what_a_full_load_finds(where: str, loads: list[str]) -> None:
    if where == "before_idat":
        buf = io.BytesIO()
        Image.new("RGB", (300, 200)).save(buf, "PNG", exif=_exif_payload(6))
        data = buf.getvalue()
    else:
        data = _with_chunk_after_idat(_plain_png(300, 200), b"eXIf", _exif_payload(6))
    header = read_header(data)
    assert loads == []
    assert header.orientation == 6 and header.upright_size == (200, 300)
    assert _fully_loaded_orientation(data) == 6


def test_png_xmp_orientation_after_idat_is_found(loads: list[str]) -> None:
    xmp = b'<x:xmpmeta><rdf:Description tiff:Orientation="8"/></x:xmpmeta>'
    data = _with_chunk_after_idat(_plain_png(300, 200), b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + xmp)
    assert read_header(data).orientation == 8
    assert loads == []
    assert _fully_loaded_orientation(data) == 8


def test_a_truncated_chunk_after_idat_leaves_the_orientation_as_stored() -> None:
    data = _with_chunk_after_idat(_plain_png(30, 20), b"eXIf", _exif_payload(3))
    cut = data[:data.index(b"eXIf") + 10]
    assert read_header(cut).orientation == 1
