"""Evaluations Hearth ships and generates itself."""
