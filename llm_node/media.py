"""Image bytes from an OpenAI `image_url`: a base64 `data:image/...` URI, or an allowed http(s) URL.

URLs are fetched only from hosts listed in --allowed-media-domains (none by default), with
a byte cap (the node's --max-image-bytes) read incrementally, a total time limit and no
redirects, so a request cannot make the node fetch arbitrary addresses or unbounded data.
Every refusal is an InvalidArgument naming the image's index in the request.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from encdis.client.errors import InvalidArgument

_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


def decode_data_uri(index: int, url: str, max_bytes: int) -> bytes:
    m = _DATA_URI.match(url)
    if m is None:
        raise InvalidArgument.for_image(index, "malformed data URI")
    mime = (m.group("mime") or "").lower()
    if not mime.startswith("image/"):
        raise InvalidArgument.for_image(index, f"data URI of type {mime or 'text/plain'!r} is not an image")
    if not m.group("b64"):
        raise InvalidArgument.for_image(index, "data URI must be base64-encoded")
    payload = url[m.end():]
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise InvalidArgument.for_image(index, f"more than the limit of {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument.for_image(index, "data URI is not valid base64") from None
    if not data:
        raise InvalidArgument.for_image(index, "empty")
    return data


async def fetch_url(index: int, url: str, *, allowed_domains: Sequence[str], max_bytes: int,
                    timeout_seconds: float) -> bytes:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise InvalidArgument.for_image(index, f"unsupported URL scheme {parts.scheme!r} (data:, http or https)")
    host = (parts.hostname or "").lower()
    if host not in {d.lower() for d in allowed_domains}:
        raise InvalidArgument.for_image(index, f"URL host {host!r} is not in --allowed-media-domains")
    import aiohttp

    try:
        timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                raise InvalidArgument.for_image(index, f"fetching the URL gave HTTP {resp.status}")
            if resp.content_length is not None and resp.content_length > max_bytes:
                raise InvalidArgument.for_image(index, f"{resp.content_length} bytes exceeds the limit {max_bytes}")
            data = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                data += chunk
                if len(data) > max_bytes:
                    raise InvalidArgument.for_image(index, f"more than the limit of {max_bytes} bytes")
            return bytes(data)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise InvalidArgument.for_image(index, f"fetching the URL failed ({type(e).__name__})") from None


async def load_image_url(index: int, url: str, *, allowed_domains: Sequence[str], max_bytes: int,
                         timeout_seconds: float) -> bytes:
    """The bytes an `image_url` names (not yet decoded: the encoder decodes them)."""
    if url[:5].lower() == "data:":
        return decode_data_uri(index, url, max_bytes)
    return await fetch_url(index, url, allowed_domains=allowed_domains, max_bytes=max_bytes,
                           timeout_seconds=timeout_seconds)
