"""Speculative decoding: drafters propose tokens, the verifier accepts a prefix of them losslessly."""

from inference.spec.drafter import Draft, Drafter, DraftRequest
from inference.spec.ngram import NgramDrafter
from inference.spec.rejection import rejection_sample, verify_greedy

__all__ = ["Draft", "DraftRequest", "Drafter", "NgramDrafter", "rejection_sample", "verify_greedy"]
