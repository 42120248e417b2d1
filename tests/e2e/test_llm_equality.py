"""encdis generates exactly what the monolithic model generates.

Real processes on loopback: two encoder nodes, one LLM node (vLLM, vision tower not
loaded), and vLLM's own monolithic run on the same checkpoint with raw images as the
reference. Greedy token ids must be equal, not close: for one image, for three images of
different sizes in one request (in two orders), and for eight concurrent requests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from encdis.client import GenerateClient, InvalidArgument
from encdis.client.errors import IMAGE_INVALID
from tests.e2e.conftest import concurrent_token_ids
from tests.integration.test_coordinator import png

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def generate_ids(address: str, case) -> list[int]:
    with GenerateClient(address, timeout=300) as client:
        result = client.generate(case.prompt, case.images, max_tokens=case.max_tokens, ignore_eos=True)
    assert result.finish_reason == "length"
    return result.token_ids


def test_llm_node_holds_no_vision_tower(llm_node):
    # The node probes its vLLM workers (collective_rpc) before it reports ready.
    assert llm_node.info["vision_tower_parameters"] == 0


def test_one_image_equals_monolithic(monolithic, llm_node, equality_cases):
    case = equality_cases["one_image"]
    ids = generate_ids(llm_node.address, case)
    assert len(ids) == case.max_tokens
    assert ids == monolithic["one_image"]


def test_three_images_of_different_sizes_equal_monolithic(monolithic, llm_node, equality_cases):
    for name in ("three_images", "three_images_reordered"):
        assert generate_ids(llm_node.address, equality_cases[name]) == monolithic[name], name
    # The order of the images matters to the model, so the comparison above can see a mix-up.
    assert monolithic["three_images"] != monolithic["three_images_reordered"]


def test_last_message_reports_usage_and_time_split(llm_node):
    # Images no other test sends, so none is a cache hit: each is decoded and preprocessed.
    images = [png(336, 168, seed=101), png(84, 112, seed=102), png(448, 336, seed=103)]
    with GenerateClient(llm_node.address, timeout=300) as client:
        chunks = list(client.generate_stream("Describe these pictures.", images, max_tokens=4, ignore_eos=True))
    last = chunks[-1]
    assert last.finished and all(not c.finished for c in chunks[:-1])
    assert last.usage.images == 3 and last.usage.completion_tokens == 4
    # 28x28 pixels per merged token: 336x168, 84x112 and 448x336 images.
    assert last.usage.image_tokens == 12 * 6 + 3 * 4 + 16 * 12
    assert last.usage.prompt_tokens > last.usage.image_tokens
    t = last.timing
    assert t.total > 0 and t.prefill > 0
    assert t.preprocess > 0  # the encoders decoded and preprocessed three images
    # The coordinator's parts are each measured on its own, over calls that overlap (the image queued
    # longest need not be the one with the longest forward): each lies within the encode span, which
    # comes before prefill and decode, but they need not add up.
    assert max(t.queue + t.preprocess, t.encode, t.transfer) + t.prefill + t.decode <= t.total + 1e-3


async def test_eight_concurrent_requests_equal_monolithic(monolithic, llm_node, equality_cases):
    got = await concurrent_token_ids(llm_node.address, equality_cases)
    assert got == {name: monolithic[name] for name in got}


def test_images_are_spread_over_both_encoders(llm_node, encoder_nodes, equality_cases):
    generate_ids(llm_node.address, equality_cases["three_images"])
    with GenerateClient(llm_node.address, timeout=60) as client:
        encoders = client.list_encoders()
    assert sorted(e.address for e in encoders) == sorted(n.address for n in encoder_nodes)
    assert all(e.state == "serving" for e in encoders)
    assert all(e.assigned_images > 0 and e.assigned_patches > 0 for e in encoders)


def test_generate_command_json_equals_monolithic(monolithic, llm_node, equality_cases, tmp_path):
    case = equality_cases["one_image"]
    image = tmp_path / "square.png"
    image.write_bytes(case.images[0])
    out = subprocess.run(
        [sys.executable, "-m", "encdis.cli", "generate", "--server", llm_node.address, "--prompt", case.prompt,
         "--image", str(image), "--max-tokens", str(case.max_tokens), "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout)
    assert result["token_ids"] == monolithic["one_image"]
    assert isinstance(result["text"], str) and result["text"]


def test_bad_image_is_invalid_argument_naming_it_and_the_node_keeps_serving(monolithic, llm_node, equality_cases):
    case = equality_cases["one_image"]
    with GenerateClient(llm_node.address, timeout=120) as client:
        with pytest.raises(InvalidArgument, match="image 1") as info:
            client.generate("Describe.", [case.images[0], b"this is not an image"], max_tokens=4)
        assert (info.value.image_index, info.value.reason) == (1, IMAGE_INVALID)  # details reach SDK callers
        with pytest.raises(InvalidArgument, match="max_tokens"):
            client.generate("Describe.", [], max_tokens=10**6)
    assert generate_ids(llm_node.address, case) == monolithic["one_image"]


def test_metrics_report_requests_and_their_time_split(llm_node, equality_cases):
    import urllib.request

    generate_ids(llm_node.address, equality_cases["one_image"])
    text = urllib.request.urlopen(f"http://127.0.0.1:{llm_node.metrics_port}/metrics", timeout=10).read().decode()
    samples = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples['encdis_requests_total{code="OK"}'] >= 1
    for part in ("queue", "preprocess", "encode", "transfer", "prefill", "decode", "total"):
        assert samples[f"encdis_request_{part}_seconds_count"] >= 1, part
    assert samples["encdis_completion_tokens_total"] >= equality_cases["one_image"].max_tokens
    assert any(name.startswith("encdis_coordinator_assignments_total") for name in samples)
