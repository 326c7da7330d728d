"""Model facts: loading (the offline default, transformers ids, GGUF files), RoPE channel pairs
and the key/value/output projection weights, read from the model itself."""
