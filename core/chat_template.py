"""The Qwen3 keep-thinking chat template, renderable without a tokenizer.

The worker renders conversations with the same Jinja file the tokenizer carries
(`qwen3_keepthink.jinja`, see its header for what it renders and why it is append-only), in a
Jinja environment set up the way `transformers` sets up `apply_chat_template` (sandboxed,
`trim_blocks`, `lstrip_blocks`, `raise_exception`), so both produce the same string.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_PATH = Path(__file__).with_name("qwen3_keepthink.jinja")

# transformers copies a message's reasoning from any of these keys into `reasoning_content`
# before rendering; render_chat does the same so both paths agree.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def load_chat_template() -> str:
    """The template's source text, as stored in the tiny model's `tokenizer_config.json`."""
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@functools.cache
def _compiled_template() -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(load_chat_template())


def _with_reasoning_alias(message: Mapping[str, Any]) -> dict[str, Any]:
    plain = {key: value for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in _REASONING_KEYS if key in plain), None)
    if reasoning is not None:
        plain["reasoning_content"] = reasoning
    return plain


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    enable_thinking: bool = True,
) -> str:
    """Render `messages` (dicts with `role`, `content`, optional `reasoning_content`) to the prompt text.

    Equal to `tokenizer.apply_chat_template(messages, tokenize=False, ...)` on the tiny model's
    tokenizer. Raises `jinja2.TemplateError` for an unknown role or non-string content.
    """
    plain = [_with_reasoning_alias(message) for message in messages]
    return _compiled_template().render(
        messages=plain,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )
