"""What a request asks its output to match: a JSON schema, any JSON object, a regex, one of a list of strings,
an EBNF grammar, or an xgrammar structural tag (free text in which tagged regions, such as tool calls, follow a
schema). The engine compiles it once per distinct content (`key`) and masks each step's logits with it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from inference.errors import InvalidRequestError

# A constraint is request data: bound it like any other field so a hostile body cannot make compile unbounded.
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024


class ConstraintKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    JSON_OBJECT = "json_object"  # spec: "" (any JSON object)
    REGEX = "regex"  # spec: the pattern
    CHOICE = "choice"  # spec: a JSON list of the allowed strings
    EBNF = "ebnf"  # spec: a GBNF/EBNF grammar with a `root` rule
    STRUCTURAL_TAG = "structural_tag"  # spec: xgrammar StructuralTag JSON


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: ConstraintKind
    spec: str = ""

    def __post_init__(self) -> None:
        try:
            kind = ConstraintKind(self.kind)
        except ValueError:
            raise InvalidRequestError(f"unknown constraint kind {self.kind!r}") from None
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.spec, str):
            raise InvalidRequestError("a constraint's spec must be a string")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"the {kind.value} is too large ({len(self.spec):,} characters; "
                                      f"at most {MAX_SPEC_CHARS:,})")
        if kind is ConstraintKind.JSON_OBJECT:
            if self.spec:
                raise InvalidRequestError("json_object takes no spec")
        elif not self.spec:
            raise InvalidRequestError(f"the {kind.value} is empty")
        if kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.CHOICE, ConstraintKind.STRUCTURAL_TAG):
            try:
                value = json.loads(self.spec)
            except ValueError as exc:
                raise InvalidRequestError(f"the {kind.value} is not valid JSON: {exc}") from None
            if kind is ConstraintKind.JSON_SCHEMA and not isinstance(value, dict | bool):
                raise InvalidRequestError("a JSON schema must be an object or a boolean")
            if kind is ConstraintKind.CHOICE and not (
                    isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
                    and all(isinstance(v, str) and v for v in value)):
                raise InvalidRequestError(f"choices must be a list of 1 to {MAX_CHOICES} non-empty strings")
            if kind is ConstraintKind.STRUCTURAL_TAG and not isinstance(value, dict):
                raise InvalidRequestError("a structural tag must be a JSON object")

    # Keys keep their order (no sort_keys): a schema's property order is the order the grammar makes the model
    # write them in, and the order a prompt shows them.
    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> Constraint:
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls(ConstraintKind.CHOICE, json.dumps(list(options)))

    @classmethod
    def ebnf(cls, grammar: str) -> Constraint:
        return cls(ConstraintKind.EBNF, grammar)

    @classmethod
    def structural_tag(cls, tag: dict[str, Any]) -> Constraint:
        return cls(ConstraintKind.STRUCTURAL_TAG, json.dumps(tag, separators=(",", ":")))

    @property
    def key(self) -> str:
        """Content hash: equal constraints share one compiled grammar, whoever sent them."""
        return hashlib.blake2b(f"{self.kind.value}\0{self.spec}".encode(), digest_size=16).hexdigest()
