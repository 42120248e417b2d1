"""The embedding datatype is part of an encoder's identity and of every image's digest.

A real encoder node running its tower in bfloat16 (CPU) beside the coordinator's default
FP32 pool: refused with a reason naming both datatypes, no work sent to it. A coordinator
that expects BF16 on purpose takes it, and the embeddings it gets are BF16 under a digest
that names BF16, so they can never be served from (or into) an FP32 cache entry.
"""

from __future__ import annotations

import pytest
import torch

from encdis.client.wire import content_digest
from encdis.launcher import NodeProcess
from tests.integration.test_coordinator import (
    MAX_PIXELS,
    MIN_PIXELS,
    NODE_TIMEOUT,
    coordinator,
    encoder_args,
    png,
    states,
    wait_for,
)


@pytest.fixture(scope="module")
def bf16_encoder(tiny_ckpt):
    node = NodeProcess([*encoder_args(tiny_ckpt, "127.0.0.1"), "--dtype", "bfloat16"], host="127.0.0.1")
    try:
        node.wait_ready(NODE_TIMEOUT)
        yield node
    finally:
        node.stop()


async def test_an_encoder_of_another_datatype_is_refused_naming_both(bf16_encoder, tiny_ckpt) -> None:
    async with coordinator(tiny_ckpt, [bf16_encoder.address], encoder_wait_seconds=1.0) as coord:
        await wait_for(lambda: states(coord) == {bf16_encoder.address: "refused"}, what="the BF16 encoder refused")
        reason = coord.encoders()[0].reason
        assert "embedding datatype BF16 differs from the LLM node's FP32" in reason, reason
    assert bf16_encoder.metric("encdis_encoder_patches_total") == 0


async def test_a_pool_that_expects_bf16_gets_bf16_under_a_digest_naming_it(bf16_encoder, tiny_ckpt) -> None:
    image = png(112, 84, seed=4242)
    async with coordinator(tiny_ckpt, [bf16_encoder.address], encoder_datatype="BF16") as coord:
        await wait_for(lambda: states(coord) == {bf16_encoder.address: "serving"}, what="the BF16 encoder serving")
        (embedded,) = (await coord.encode([image])).images
    assert embedded.embeds.dtype == torch.bfloat16
    fp = coord.weights_fingerprint
    # Below FP32 the pool runs vLLM's tower by default (--tower-impl auto on both sides).
    assert embedded.digest == content_digest(image, MIN_PIXELS, MAX_PIXELS, fp, datatype="BF16", tower_impl="vllm")
    assert embedded.digest != content_digest(image, MIN_PIXELS, MAX_PIXELS, fp, datatype="FP32")
