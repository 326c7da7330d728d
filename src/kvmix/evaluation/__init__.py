"""Quality evaluation: offline text, scoring through the cache (perplexity, token KL), long
generation, needle retrieval, lm-evaluation-harness tasks, analyses over captured attention
inputs and WUSH calibration."""
