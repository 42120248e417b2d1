"""An encoded image's header, read without decoding its pixels: the one probe of image bytes.

Both sides use it: the coordinator, to count an image's patches before any encoder sees it,
and the encoder node, to validate an image before it spends memory decoding it. One
allowlist of formats for both, so an image the coordinator accepts is one the encoder can
open, and anything else (EPS, PSD, SVG, ...) is refused before a decoder runs.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

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
                             orientation=_orientation(image))
    if width <= 0 or height <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    return header


def _orientation(image: Image.Image) -> int:
    try:
        value = int(image.getexif().get(0x0112, 1))
    except Exception:  # a broken EXIF block: vLLM's loader ignores it too
        return 1
    return value if 1 <= value <= 8 else 1
