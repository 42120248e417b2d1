"""An encoded image's header, read without decoding its pixels: the one probe of image bytes.

Both sides use it: the coordinator, to count an image's patches before any encoder sees it,
and the encoder node, to validate an image before it spends memory decoding it. One
allowlist of formats for both, so an image the coordinator accepts is one the encoder can
open, and anything else (EPS, PSD, SVG, ...) is refused before a decoder runs.

No pixel is decoded, whatever the image's size: PIL's `getexif()` on a PNG decodes the whole
image to reach chunks after the pixel data, so a PNG's orientation is read from its chunks
instead (an eXIf or EXIF/XMP text chunk, before or after IDAT, as PIL's full load finds them).
"""

from __future__ import annotations

import io
import struct
import warnings
from dataclasses import dataclass

from PIL import Image, PngImagePlugin

# What PIL may open.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass(frozen=True)
class ImageHeader:
    """What the file says about itself."""

    format: str
    width: int
    height: int
    mode: str
    orientation: int = 1  # EXIF orientation (1: as stored)

    @property
    def upright_size(self) -> tuple[int, int]:
        """(width, height) once EXIF orientation is applied: 5-8 turn the image by 90 degrees."""
        return (self.height, self.width) if self.orientation in (5, 6, 7, 8) else (self.width, self.height)


def open_image(data: bytes) -> Image.Image:
    """PIL's lazy open (header parsed, pixels not decoded); ValueError naming what is wrong."""
    if not data:
        raise ValueError("empty image data (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Callers apply their own pixel limits to the header's size; PIL's bomb warning
            # would only add noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError as e:
        raise ValueError(f"header claims too many pixels: {e}") from None
    except Image.UnidentifiedImageError:
        raise ValueError(
            "unsupported or corrupt image data: not a recognised image format "
            f"(accepted formats: {', '.join(ALLOWED_FORMATS)})"
        ) from None
    except (OSError, SyntaxError, EOFError) as e:  # truncated or corrupt headers
        raise ValueError(f"corrupt image header: {e}") from None
    except Exception as e:  # a malformed header can make a PIL plugin raise anything
        raise ValueError(f"unreadable image header: {e}") from None


def read_header(data: bytes) -> ImageHeader:
    """Format, size and mode of an encoded image; ValueError for garbage or an empty image."""
    with open_image(data) as image:
        width, height = image.size
        header = ImageHeader(format=str(image.format), width=width, height=height, mode=image.mode,
                             orientation=_orientation(image, data))
    if width <= 0 or height <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    return header


def _orientation(image: Image.Image, data: bytes) -> int:
    try:
        if image.format == "PNG":
            value = _png_orientation(image, data)
        else:  # the other formats' getexif() reads what the header parse already found
            value = int(image.getexif().get(ORIENTATION_TAG, 1))
    except Exception:  # a broken EXIF block: vLLM's loader ignores it too
        return 1
    return value if 1 <= value <= 8 else 1


ORIENTATION_TAG = 0x0112
PNG_SIGNATURE_BYTES = 8
# Chunks that can carry an orientation (PIL's getexif reads eXIf, "Raw profile type exif" and XMP text).
_PNG_ORIENTATION_CHUNKS = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")


def _png_orientation(image: Image.Image, data: bytes) -> int:
    """The orientation PIL's full load would find, without decoding: chunks after IDAT are
    walked by their lengths and only the metadata ones are parsed (with PIL's own handlers)."""
    if "exif" not in image.info:
        image.info.update(_png_metadata_after_idat(data))
    # The base class's getexif reads image.info only; PngImageFile's would load the pixels first.
    return int(Image.Image.getexif(image).get(ORIENTATION_TAG, 1))


def _png_metadata_after_idat(data: bytes) -> dict:
    stream = PngImagePlugin.PngStream(io.BytesIO(data))
    pos, seen_idat = PNG_SIGNATURE_BYTES, False
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IEND" or (seen_idat and kind == b"fcTL"):  # fcTL: the next frame, where PIL stops
            break
        seen_idat = seen_idat or kind == b"IDAT"
        if seen_idat and kind in _PNG_ORIENTATION_CHUNKS:
            stream.fp.seek(pos + 8)
            try:
                stream.call(kind, pos + 8, length)
            except (UnicodeDecodeError, ValueError, OSError, EOFError):
                break  # a broken or truncated chunk ends what PIL's load would read too
        pos += 12 + length  # length, type, data, CRC
    return stream.im_info
