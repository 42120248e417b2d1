"""The node's MediaLoader against a real HTTP server on 127.0.0.1: a request's image URLs are
fetched concurrently, over one shared session (its connections reused across requests), with
the byte cap; the first refusal names its image."""

from __future__ import annotations

import asyncio

import pytest

from tests.needs import require_module

require_module("aiohttp")

from aiohttp import web  # noqa: E402

from encdis.client.errors import InvalidArgument  # noqa: E402
from encdis.llm_node.media import MediaLoader  # noqa: E402

IMAGES = 4
MAX_BYTES = 1024
HANG_GUARD_SECONDS = 60  # a guard against a hang when fetches run one at a time, not a timing claim


@pytest.fixture
async def server():
    """Serves /img/N once all IMAGES requests are in progress at the same time (a barrier)."""
    arrived: list[asyncio.Event] = []
    peers: list[tuple] = []
    all_in = asyncio.Event()

    async def image(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        arrived.append(asyncio.Event())
        if len(arrived) % IMAGES == 0:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), HANG_GUARD_SECONDS)
        return web.Response(body=request.match_info["n"].encode() * 10)

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (MAX_BYTES + 1))

    app = web.Application()
    app.router.add_get("/img/{n}", image)
    app.router.add_get("/big", big)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", peers, all_in
    await runner.cleanup()


async def test_a_requests_urls_are_fetched_together_on_one_session(server) -> None:
    base, peers, all_in = server
    loader = MediaLoader(allowed_domains=["127.0.0.1"], max_bytes=MAX_BYTES, timeout_seconds=HANG_GUARD_SECONDS)
    try:
        urls = [f"{base}/img/{i}" for i in range(IMAGES)]
        # Each answer waits for all the others to arrive: fetched one at a time, none would come.
        assert await loader.load_all(urls) == [str(i).encode() * 10 for i in range(IMAGES)]
        first = set(peers)
        all_in.clear()
        assert await loader.load_all(urls) == [str(i).encode() * 10 for i in range(IMAGES)]
        assert set(peers[IMAGES:]) <= first  # the second request reused the session's connections
    finally:
        await loader.close()


async def test_the_byte_cap_and_the_host_list_hold_naming_the_image(server) -> None:
    base, _, _ = server
    loader = MediaLoader(allowed_domains=["127.0.0.1"], max_bytes=MAX_BYTES, timeout_seconds=HANG_GUARD_SECONDS)
    try:
        with pytest.raises(InvalidArgument, match=f"image 1: .*exceeds the limit {MAX_BYTES}"):
            await loader.load_all(["data:image/png;base64,iVBORw0K", f"{base}/big"])
        with pytest.raises(InvalidArgument, match="image 0: URL host 'localhost' is not in"):
            await loader.load_all([base.replace("127.0.0.1", "localhost") + "/img/0"])
    finally:
        await loader.close()
