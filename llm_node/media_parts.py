"""A chat request's media parts: found in order, then replaced by the embeddings the pool made of them.

The door hands vLLM's renderer no raw media: each image part (`image_url`, or the Responses-style
`input_image`, with or without its `type`) becomes vLLM's `image_embeds` part carrying only the
image's grid and its content digest as uuid; the node's encoder-cache connector gives the workers
the rows under that digest (llm_node/ec_connector.py). Any other media part (audio, video, a
caller's own embeddings, PIL objects), and a caller's `uuid` on an image (a key into the node's
cache of other requests' embeddings), is refused by name. Which keys mark a part as media is
vLLM's own table, so a part vLLM would read as media is never passed through unseen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from encdis.client.errors import FieldViolation, InvalidArgument

IMAGE_PART_TYPES = ("image_url", "input_image")


def _media_keys() -> frozenset[str]:
    from vllm.renderers.chat_utils import _MEDIA_CONTENT_PART_KEYS

    return frozenset(_MEDIA_CONTENT_PART_KEYS)


@dataclass(frozen=True)
class ImagePart:
    message: int
    part: int
    url: str


def _refuse(m: int, p: int, why: str) -> InvalidArgument:
    where = f"messages[{m}].content[{p}]"
    return InvalidArgument(f"{where}: {why}", violations=[FieldViolation(where, why)])


def _image_url(m: int, p: int, part: dict[str, Any]) -> str:
    if part.get("uuid") is not None:
        raise _refuse(m, p, "a uuid on an image is not accepted: the node keys images by their content")
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise _refuse(m, p, "image_url has no url")
    return url


def image_parts(messages: Any) -> list[ImagePart]:
    """Every image part of `messages` in order; InvalidArgument for a media part the node does not take."""
    if not isinstance(messages, list):
        return []  # not a chat request: vLLM's validation names the problem
    media = _media_keys()
    found: list[ImagePart] = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            keys = ({kind} if isinstance(kind, str) else set()) | set(part)
            if kind in IMAGE_PART_TYPES or (kind is None and "image_url" in part):
                found.append(ImagePart(m, p, _image_url(m, p, part)))
            elif keys & media:
                what = kind if kind in media else sorted(keys & media)[0]
                raise _refuse(m, p, f"part type {what!r} is not supported (images come as image_url)")
    return found


def replace_images(messages: list[dict[str, Any]], parts: Sequence[ImagePart],
                   grids: Sequence[Sequence[int]], digests: Sequence[str]) -> None:
    """Each image part in place as an `image_embeds` part: its grid and its digest (the rows' key)."""
    for part, grid, digest in zip(parts, grids, digests, strict=True):
        messages[part.message]["content"][part.part] = {
            "type": "image_embeds", "image_embeds": {"image_grid_thw": [int(x) for x in grid]}, "uuid": digest}


def message_text(messages: list[dict[str, Any]]) -> str:
    """All the text of `messages` (string contents and text parts), for a bound on its tokens."""
    pieces: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            pieces.append(content)
        elif isinstance(content, list):
            pieces += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "".join(pieces)
