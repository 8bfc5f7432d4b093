"""lm-eval harness extension."""
