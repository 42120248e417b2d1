"""Encoder pool pieces that need no server: target parsing and the refusal rule."""

from __future__ import annotations

import dataclasses

import pytest

from encdis.client.encoder_client import EncoderDescription
from encdis.llm_node.coordinator.discovery import Resolver, is_ip_literal, join_host_port, split_host_port
from encdis.llm_node.coordinator.identity import ModelIdentity, expected_tower_impl, refusal_reason


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("127.0.0.1:50051", ("127.0.0.1", 50051)),
        ("encoders.default.svc.cluster.local:50051", ("encoders.default.svc.cluster.local", 50051)),
        ("[::1]:7000", ("::1", 7000)),
        (" enc-0:1 ", ("enc-0", 1)),
    ],
)
def test_targets_parse(target: str, expected: tuple[str, int]) -> None:
    assert split_host_port(target) == expected


@pytest.mark.parametrize("target", ["encoders", "encoders:", ":50051", "host:http", "host:0", "host:70000",
                                    "::1:7000", "[::1]7000"])
def test_bad_targets_are_rejected_with_the_address_in_the_message(target: str) -> None:
    with pytest.raises(ValueError, match="encoder address"):
        split_host_port(target)


def test_addresses_round_trip() -> None:
    assert join_host_port("::1", 7000) == "[::1]:7000"
    assert join_host_port("10.0.0.7", 7000) == "10.0.0.7:7000"
    assert is_ip_literal("10.0.0.7") and is_ip_literal("::1") and not is_ip_literal("encoders")


async def test_system_resolver_reads_hosts_and_reports_missing_names_as_empty() -> None:
    resolver = Resolver()
    assert "127.0.0.1" in (await resolver.resolve("localhost") or [])
    assert await resolver.resolve("no-such-encoder.invalid") == []


def test_dns_server_must_be_an_ip_and_port() -> None:
    with pytest.raises(ValueError, match="IP:port"):
        Resolver("dns.example:53")


IDENTITY = ModelIdentity(weights_fingerprint="ab" * 32, hidden_size=128, min_pixels=3136, max_pixels=200704)
DESCRIPTION = EncoderDescription(
    vision_config={}, out_hidden_size=128, weights_fingerprint="ab" * 32, device="cpu", datatype="FP32",
    max_batch_patches=16384, max_images_per_request=64, max_image_bytes=1 << 25, max_image_pixels=1 << 26,
    min_pixels=3136, max_pixels=200704, patch_size=14, merge_size=2, temporal_patch_size=2, boot_id="b",
    hostname="h", version="0", max_chunk_bytes=1 << 22, image_loader="vllm", tower_impl="transformers",
)


def test_matching_encoder_is_accepted() -> None:
    assert refusal_reason(DESCRIPTION, IDENTITY) is None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"weights_fingerprint": "cd" * 32}, "weights_fingerprint"),
        ({"out_hidden_size": 256}, "out_hidden_size 256"),
        ({"patch_size": 16}, "patch_size 16"),
        ({"max_pixels": 100000}, "max_pixels 100000"),
        ({"min_pixels": 10000}, "min_pixels 10000"),
        ({"tower_impl": "vllm"}, "tower_impl 'vllm' differs from the pool's 'transformers'"),
        ({"tower_impl": ""}, "tower_impl 'unreported'"),
    ],
)
def test_mismatched_encoder_is_refused_with_the_reason(change: dict, words: str) -> None:
    reason = refusal_reason(dataclasses.replace(DESCRIPTION, **change), IDENTITY)
    assert reason is not None and words in reason


@pytest.mark.parametrize(("setting", "datatype", "impl"), [
    ("auto", "FP32", "transformers"), ("auto", "BF16", "vllm"), ("auto", "FP16", "vllm"),
    ("transformers", "BF16", "transformers"), ("vllm", "FP32", "vllm"),
])
def test_the_pool_expects_vllms_tower_below_fp32_unless_told(setting: str, datatype: str, impl: str) -> None:
    assert expected_tower_impl(setting, datatype) == impl
