"""`encdis pool` against a real GenerateService front door over a real coordinator.

One real encoder node (a subprocess on 127.0.0.1) and a FakeEncoder (tests/fake_encoder.py, a
real gRPC EncoderService that sends rows the wrong size) sit in a real Coordinator; the LLM
node's GenerateServicer serves it on a real gRPC server behind the node's API key check, with
no engine (ListEncoders reads the coordinator only). The `encdis pool` command runs as a
subprocess, as an operator runs it, and must show the fake quarantined with its reason.
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import pytest

from encdis import serving
from encdis.auth import ApiKeys
from encdis.auth import interceptors as auth_interceptors
from encdis.client.pb import llm_pb2_grpc
from encdis.launcher import NodeProcess
from encdis.llm_node.grpc_front import GenerateServicer
from tests.fake_encoder import FakeEncoder
from tests.integration.test_coordinator import NODE_TIMEOUT, coordinator, encoder_args, png, wait_for

API_KEY = "pool-test-key-0123456789"


@pytest.fixture(scope="module")
def real(tiny_ckpt):
    node = NodeProcess(encoder_args(tiny_ckpt, "127.0.0.1"), host="127.0.0.1").wait_ready(NODE_TIMEOUT)
    try:
        yield node
    finally:
        node.stop()


async def front_door(coord) -> tuple[grpc.aio.Server, str]:
    """The LLM node's gRPC front door over `coord`, with no generation service behind it."""
    server = grpc.aio.server(interceptors=[*auth_interceptors(ApiKeys([API_KEY])),
                                           serving.ErrorMappingInterceptor()])
    llm_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(None, None, coord), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def encdis(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "encdis.cli", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def test_pool_shows_a_quarantined_fake_with_its_reason(real, tiny_ckpt, tmp_path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"# the front door's key\n{API_KEY}\n")
    fake = await FakeEncoder(tiny_ckpt).start()
    fake.rows_delta = 4  # a self-consistent stream of the wrong size: refused, then quarantined
    try:
        async with coordinator(tiny_ckpt, [fake.address, real.address], quarantine_seconds=60.0) as coord:
            await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
            await coord.encode([png(224, 224 - 28 * i, seed=40 + i) for i in range(4)])
            assert fake.calls > 0, "the fake got no image: nothing was tested"
            await wait_for(lambda: next(e for e in coord.encoders() if e.address == real.address).has_report,
                           what="the real encoder's first load report")
            server, address = await front_door(coord)
            try:
                rc, out, err = await encdis("pool", "--server", address, "--json", "--api-key-file", str(key_file))
                assert rc == 0, err
                shown = {e["address"]: e for e in json.loads(out)["encoders"]}
                assert shown.keys() == {fake.address, real.address}
                bad = shown[fake.address]
                assert bad["state"] == "quarantined" and "rows x hidden" in bad["reason"], bad
                assert (bad["faults"], bad["backoff_seconds"]) == (1, 60.0)
                assert 0 < bad["backoff_remaining_seconds"] <= 60.0
                good = shown[real.address]
                assert good["state"] == "serving" and good["faults"] == 0 and good["assigned_images"] > 0
                assert set(good["report"]) == {"queued_patches", "images_in_flight", "drain_seconds", "utilization"}

                rc, out, err = await encdis("pool", "--server", address, "--api-key-file", str(key_file))
                assert rc == 0, err
                header, *rows = out.strip().splitlines()
                assert header.split()[:3] == ["ENCODER", "STATE", "QUEUE"]
                [fake_row] = [r for r in rows if r.startswith(fake.address)]
                assert "quarantined" in fake_row and "rows x hidden" in fake_row
                assert "60s (" in fake_row and "s left)" in fake_row  # the back-off and its time left
                [real_row] = [r for r in rows if r.startswith(real.address)]
                assert "serving" in real_row and "s ago)" in real_row  # its last load report and its age

                # Without the key the front door refuses, and the command says so instead of a table.
                rc, out, err = await encdis("pool", "--server", address)
                assert rc == 1 and out == "" and "UNAUTHENTICATED" in err.upper(), (out, err)
            finally:
                await server.stop(None)
    finally:
        await fake.stop()


async def test_pool_names_a_bad_flag_before_calling_anything() -> None:
    rc, out, err = await encdis("pool", "--server", "127.0.0.1:1", "--cert", "/nonexistent.pem")
    assert rc == 2 and "--cert and --key" in err
    rc, out, err = await encdis("pool", "--server", "127.0.0.1:1", "--watch", "0")
    assert rc == 2 and "--watch" in err
