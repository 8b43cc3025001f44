"""Grammar-constrained decoding: what a request may ask (`Constraint`) and how the engine holds it."""

from inference.constrained.constraint import Constraint, ConstraintKind

__all__ = ["Constraint", "ConstraintKind"]
