"""Test images as encoded files, one per kind of input an encoder node must handle."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def _noise(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    # Smooth-ish content plus noise, so JPEG/palette conversion keeps structure.
    yy, xx = np.mgrid[0:h, 0:w]
    grad = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) % 256], -1).astype(np.uint16)
    return Image.fromarray(((grad + base) // 2).astype(np.uint8), "RGB")


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def rgb_jpeg(w: int = 320, h: int = 240, seed: int = 0) -> bytes:
    return encode(_noise(w, h, seed), "JPEG", quality=90)


def rgba_png() -> bytes:
    img = _noise(200, 150, 1).convert("RGBA")
    alpha = np.tile(np.linspace(0, 255, 200, dtype=np.uint8), (150, 1))
    img.putalpha(Image.fromarray(alpha, "L"))
    return encode(img, "PNG")


def gray_jpeg() -> bytes:
    return encode(_noise(180, 260, 2).convert("L"), "JPEG", quality=90)


def palette_png() -> bytes:
    return encode(_noise(150, 150, 3).convert("P", palette=Image.Palette.ADAPTIVE, colors=64), "PNG")


def cmyk_jpeg() -> bytes:
    return encode(_noise(210, 170, 4).convert("CMYK"), "JPEG", quality=90)


def png16() -> bytes:
    yy, xx = np.mgrid[0:140, 0:190]
    return encode(Image.fromarray(((xx * 300 + yy * 97) % 65536).astype(np.uint16)), "PNG")


def smallest() -> bytes:
    return encode(Image.new("RGB", (1, 1), (200, 30, 90)), "PNG")


def extreme_aspect() -> bytes:
    """4000x20: aspect ratio 200, the most the image processor allows."""
    return encode(_noise(4000, 20, 5), "PNG")


def near_max_pixels() -> bytes:
    """446x450 = 200700 pixels, just under the tiny checkpoint's max_pixels (200704)."""
    return encode(_noise(446, 450, 6), "JPEG", quality=90)


def exif_rotated_jpeg() -> bytes:
    """A landscape JPEG whose EXIF orientation 6 says: display rotated 90 degrees clockwise."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(_noise(240, 160, 7), "JPEG", quality=90, exif=exif.tobytes())


def palette_trns_png() -> bytes:
    """A palette PNG whose tRNS chunk makes some palette entries transparent."""
    img = _noise(160, 120, 8).convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    return encode(img, "PNG", transparency=bytes([0, 128] + [255] * 30))


def la_png() -> bytes:
    gray = _noise(130, 170, 9).convert("L")
    alpha = Image.fromarray(np.tile(np.linspace(255, 0, 130, dtype=np.uint8), (170, 1)), "L")
    return encode(Image.merge("LA", (gray, alpha)), "PNG")


KINDS = {
    "rgb_jpeg": (rgb_jpeg, "RGB"),
    "rgba_png": (rgba_png, "RGBA"),
    "gray_jpeg": (gray_jpeg, "L"),
    "palette_png": (palette_png, "P"),
    "cmyk_jpeg": (cmyk_jpeg, "CMYK"),
    "png16": (png16, "I;16"),
    "smallest": (smallest, "RGB"),
    "extreme_aspect": (extreme_aspect, "RGB"),
    "near_max_pixels": (near_max_pixels, "RGB"),
    "exif_rotated_jpeg": (exif_rotated_jpeg, "RGB"),
    "palette_trns_png": (palette_trns_png, "P"),
    "la_png": (la_png, "LA"),
}


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (its data is a few bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
