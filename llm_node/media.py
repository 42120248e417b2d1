"""Image bytes from an OpenAI `image_url`: a base64 `data:image/...` URI, or an allowed http(s) URL.

URLs are fetched only from hosts listed in --allowed-media-domains (none by default), with
a byte cap (the node's --max-image-bytes) read incrementally, a total time limit and no
redirects, so a request cannot make the node fetch arbitrary addresses or unbounded data.
Every refusal is an InvalidArgument naming the image's index in the request.

One MediaLoader per node holds one aiohttp session (its connection pool) for every fetch;
a request's images are loaded concurrently, and the first refusal cancels the rest.
Base64 decoding of large data URIs runs in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from encdis.client.errors import InvalidArgument

# Data URIs longer than this are decoded in a worker thread (base64 runs at about 1 GB/s).
OFFLOAD_DATA_URI_CHARS = 1 << 20

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


def _check_url(index: int, url: str, allowed_domains: Sequence[str]) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise InvalidArgument.for_image(index, f"unsupported URL scheme {parts.scheme!r} (data:, http or https)")
    host = (parts.hostname or "").lower()
    if host not in {d.lower() for d in allowed_domains}:
        raise InvalidArgument.for_image(index, f"URL host {host!r} is not in --allowed-media-domains")


class MediaLoader:
    """The node's image loader: data URIs decoded, URLs fetched on one shared session, with the caps."""

    def __init__(self, *, allowed_domains: Sequence[str], max_bytes: int, timeout_seconds: float) -> None:
        self.allowed_domains = tuple(allowed_domains)
        self.max_bytes = max_bytes
        self.timeout_seconds = timeout_seconds
        self._session: Any = None  # aiohttp.ClientSession, opened at the first fetch (in the serving loop)

    async def load_all(self, urls: Sequence[str]) -> list[bytes]:
        """The bytes every `image_url` names, in order (not yet decoded: the encoder decodes them)."""
        tasks = [asyncio.ensure_future(self.load(i, url)) for i, url in enumerate(urls)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # after a refusal (or cancellation) the other fetches stop too
                t.cancel()

    async def load(self, index: int, url: str) -> bytes:
        if url[:5].lower() == "data:":
            if len(url) > OFFLOAD_DATA_URI_CHARS:
                return await asyncio.to_thread(decode_data_uri, index, url, self.max_bytes)
            return decode_data_uri(index, url, self.max_bytes)
        return await self.fetch(index, url)

    async def fetch(self, index: int, url: str) -> bytes:
        _check_url(index, url, self.allowed_domains)
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        max_bytes = self.max_bytes
        try:
            async with self._session.get(url, allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_seconds)) as resp:
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

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
