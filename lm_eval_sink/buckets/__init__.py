"""Per-prompt regression buckets of two lm-eval runs of one task, with paired statistics (docs/buckets.md): the
settings, the pairing (paired.py), the statistics (stats.py), the per-doc passes (rows.py), `bucket` (compare.py),
the runs' protocols and noise floor, and the Markdown and CSV (render.py). numpy/scipy only, no file I/O here.
"""
