"""Evaluations of a model against its baseline: perplexity, KLD, long context, lm-eval."""
