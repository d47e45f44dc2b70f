"""SOLARIS: speculative precomputation of foundation-model embeddings for a fast ranker."""
__version__ = "0.1.0"
