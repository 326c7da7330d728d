"""Evaluation: offline text, scoring through the cache (perplexity, token KL), analyses over
captured attention inputs, WUSH calibration, reports and plots, and the plumbing commands share."""
