"""KV-cache compression: per-head variable eviction by received attention, on the paged cache."""

from inference.compression.compressor import (
           CompressionConfig,
           CompressionState,
           CompressionStats,
           KVCompressor,
)
from inference.compression.policy import ScoreSpread
from inference.compression.settings import EvictionMethod, KVCompressionSettings

__all__ = ["CompressionConfig", "CompressionState", "CompressionStats", "EvictionMethod", "KVCompressionSettings",
           "KVCompressor", "ScoreSpread"]
