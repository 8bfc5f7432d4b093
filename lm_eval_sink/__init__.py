"""lm-eval-sink: Sink Strength and text-capability regression tools for lm-evaluation-harness."""

__version__ = "0.1.0"
