"""Tool calls between the APIs' shapes and the engine library's tool-call format (inference.tools)."""

from __future__ import annotations

from typing import Any

from controlplane.serving.job import Tools
from inference.constrained import Constraint


def tools(raw_tools: list[Any], choice: Any, parallel: bool) -> Tools:
    raise NotImplementedError


def constraint(tools: Tools) -> Constraint:
    raise NotImplementedError


def split(text: str) -> tuple[str, list[dict[str, Any]]]:
    raise NotImplementedError


class StreamParser:
    calls: list[dict[str, Any]]

    def feed(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def finish(self) -> list[dict[str, Any]]:
        raise NotImplementedError
