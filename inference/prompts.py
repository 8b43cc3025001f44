"""Prompt rendering: chat messages through the model's template, or raw text as is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from inference.errors import InvalidRequestError

ROLES = {"system", "user", "assistant", "tool", "developer"}


def _check_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    if not isinstance(messages, list | tuple) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {sorted(ROLES)}")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError(f"messages[{i}].content: only text parts are supported")
            content = "".join(texts)
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string")
        checked.append({"role": "system" if role == "developer" else role, "content": content})
    return checked


def encode_prompt(tokenizer: PreTrainedTokenizerBase, *, prompt: str | None = None,
                  messages: Sequence[Any] | None = None, raw: bool = False) -> list[int]:
    """Token ids for a request.

    messages go through the chat template with the generation prompt appended. A prompt on a chat model is
    wrapped as one user message unless raw is set (Workers AI's rule); a model without a template takes
    prompts as they are and refuses messages.
    """
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages")
    template = getattr(tokenizer, "chat_template", None)
    if messages is not None:
        if not template:
            raise InvalidRequestError("this model has no chat template: send a raw prompt instead of messages")
        return _apply_template(tokenizer, _check_messages(messages))
    if not isinstance(prompt, str):
        raise InvalidRequestError("prompt must be a string")
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    if template and not raw:
        return _apply_template(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def _apply_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # templates raise their own errors (e.g. roles must alternate)
        raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from exc
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
