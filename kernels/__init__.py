"""Attention and cache kernels. Each op has a pure-torch reference; Triton versions sit beside their reference."""
