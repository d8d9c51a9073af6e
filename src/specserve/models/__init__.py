"""Model architectures, checkpoint loading, tokenizers and bundled model files."""
