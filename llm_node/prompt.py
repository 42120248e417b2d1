"""Prompt rendering: chat messages through the checkpoint's own chat template, with the
generation prompt added. Image parts are placeholders ({"type": "image"}); the template
turns each into the model's image tokens, in order.

The LLM node and the monolithic reference both render through this module, so a
difference in outputs can never come from a difference in prompts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def user_message(text: str, num_images: int) -> list[dict[str, Any]]:
    """The chat: one user turn whose content is `num_images` image parts, then the text."""
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def _template_from_files(model_dir: Path) -> str | None:
    """The processor's chat template, for checkpoints whose tokenizer has none."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    js = model_dir / "chat_template.json"
    if js.exists():
        return json.loads(js.read_text()).get("chat_template")
    return None


class PromptRenderer:
    """Renders prompts with a checkpoint's tokenizer and chat template (loaded once)."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        # Prefer the processor's template: it is the one that knows about images.
        self.chat_template = _template_from_files(self.model_dir) or self.tokenizer.chat_template
        if not self.chat_template:
            raise ValueError(f"{self.model_dir} has no chat template (tokenizer or chat_template.json)")

    def render(self, text: str, num_images: int) -> str:
        """One user turn: `num_images` image placeholders, then the text."""
        return self.render_messages(user_message(text, num_images))

    def render_messages(self, messages: list[dict[str, Any]]) -> str:
        """The prompt string of a whole conversation."""
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
