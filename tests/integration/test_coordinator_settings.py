"""The coordinator's wiring into the LLM node: settings, checkpoint identity, error numbering.

No servers: these check what the LLM node hands the coordinator and what the coordinator
makes of it.
"""

from __future__ import annotations

import argparse

import pytest

from encdis.checkpoint import read_processor_config, text_hidden_size, weights_fingerprint
from encdis.client.errors import IMAGE_INVALID, InvalidArgument, Unavailable
from encdis.llm_node import settings as llm_settings
from encdis.llm_node.coordinator.coordinator import Coordinator
from encdis.llm_node.coordinator.expectation import PendingImage, request_numbering
from encdis.llm_node.coordinator.identity import ModelIdentity
from encdis.llm_node.coordinator.settings import CoordinatorSettings


def test_settings_come_from_the_llm_nodes_flags_and_environment() -> None:
    parser = argparse.ArgumentParser()
    llm_settings.add_arguments(parser, environ={"ENCDIS_MAX_RETRIES": "5", "ENCDIS_CACHE_BYTES": "1024"})
    args = parser.parse_args(["--model", "/m", "--encoders", "enc.svc:50051,10.0.0.2:50051",
                              "--dns-server", "127.0.0.1:5353", "--dns-refresh-seconds", "2"])
    s = llm_settings.from_args(args).coordinator
    assert s.encoders == ("enc.svc:50051", "10.0.0.2:50051")
    assert (s.dns_server, s.dns_refresh_seconds, s.max_retries, s.cache_bytes) == ("127.0.0.1:5353", 2.0, 5, 1024)
    assert s.encode_timeout_seconds == CoordinatorSettings().encode_timeout_seconds
    assert s.encoder_datatype == "auto"  # the node resolves it to its engine's dtype


def test_identity_is_the_checkpoints(tiny_ckpt) -> None:
    coord = Coordinator.from_checkpoint(CoordinatorSettings(), None, tiny_ckpt)
    ident = coord.identity
    assert ident.weights_fingerprint == weights_fingerprint(tiny_ckpt)
    assert ident.hidden_size == text_hidden_size(tiny_ckpt)
    processor = read_processor_config(tiny_ckpt)
    assert (ident.min_pixels, ident.max_pixels) == (processor["min_pixels"], processor["max_pixels"])


def test_new_style_processor_bounds_are_read() -> None:
    processor = {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "patch_size": 14}
    ident = ModelIdentity.from_processor("f", 128, processor)
    assert (ident.min_pixels, ident.max_pixels) == (3136, 12845056)
    with pytest.raises(ValueError, match="min_pixels"):
        ModelIdentity.from_processor("f", 128, {"patch_size": 14})


def test_encoder_errors_are_renumbered_to_the_request() -> None:
    jobs = [PendingImage(index=3, digest="a", grid=(1, 8, 8), rows=16),
            PendingImage(index=5, digest="b", grid=(1, 8, 8), rows=16)]
    err = request_numbering(InvalidArgument.for_image(1, "cannot decode PNG: truncated"), jobs)
    assert err.message == "image 5: cannot decode PNG: truncated"
    assert (err.image_index, err.image_reason, err.reason) == (5, "cannot decode PNG: truncated", IMAGE_INVALID)
    err = request_numbering(InvalidArgument("min_pixels 1 is outside [3136, 200704]"), jobs[:1])
    assert err.message.startswith("image 3: ") and err.image_index == 3
    # The text is never read: an encoder whose details name no image (or one it was not sent)
    # does not get to pick which of several images is to blame.
    for untrusted in (InvalidArgument("image 1: bad"), InvalidArgument.for_image(7, "bad")):
        err = request_numbering(untrusted, jobs)
        assert err.image_index is None and err.message.startswith("one of images [3, 5]: ")


async def test_encode_before_start_is_unavailable(tiny_ckpt) -> None:
    coord = Coordinator.from_checkpoint(CoordinatorSettings(), None, tiny_ckpt)
    with pytest.raises(Unavailable):
        await coord.encode([b"x"])
    assert coord.encoders() == []
