"""Which chat content parts the door turns into embeddings, which it refuses, and the rewrite itself."""

from __future__ import annotations

import pytest

from encdis.client.errors import InvalidArgument
from encdis.llm_node.media_parts import ImagePart, image_parts, replace_images
from tests.needs import require_module

require_module("vllm")

URL = "data:image/png;base64,AAAA"


def conversation(*parts: dict) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": list(parts)}]


def test_image_parts_are_found_in_order_with_or_without_their_type() -> None:
    messages = conversation({"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": URL}},
                            {"image_url": {"url": URL + "B"}}, {"type": "input_image", "image_url": URL + "C"})
    assert image_parts(messages) == [ImagePart(1, 1, URL), ImagePart(1, 2, URL + "B"), ImagePart(1, 3, URL + "C")]


@pytest.mark.parametrize("part, named", [
    ({"type": "audio_url", "audio_url": {"url": URL}}, "'audio_url'"),
    ({"type": "video_url", "video_url": {"url": URL}}, "'video_url'"),
    ({"type": "image_embeds", "image_embeds": "AAAA"}, "'image_embeds'"),
    ({"input_audio": {"data": "AAAA", "format": "wav"}}, "'input_audio'"),
    ({"type": "image_url", "image_url": {"url": URL}, "uuid": "someone-elses"}, "uuid"),
    ({"type": "image_url", "image_url": {}}, "no url"),
])
def test_media_the_node_does_not_take_is_refused_naming_the_part(part: dict, named: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        image_parts(conversation({"type": "text", "text": "a"}, part))
    assert e.value.message.startswith("messages[1].content[1]: ") and named in e.value.message


def test_text_only_requests_have_no_image_parts() -> None:
    assert image_parts([{"role": "user", "content": "hi"}]) == []
    assert image_parts("not a list") == []


def test_replace_images_leaves_only_the_grid_and_digest() -> None:
    messages = conversation({"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": "b"})
    replace_images(messages, image_parts(messages), [(1, 4, 6)], ["d1"])
    assert messages[1]["content"][0] == {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]},
                                         "uuid": "d1"}
    assert messages[1]["content"][1] == {"type": "text", "text": "b"}
