"""Per-prompt regression buckets of two lm-eval runs of one task, with paired statistics (docs/buckets.md).

- settings.py: `BucketSettings`, every knob of a comparison.
- paired.py: `pair`, the two samples logs joined per doc under one filter and metric (the join: pairing.py).
- stats.py: the buckets, exact McNemar, the 0/1 delta interval, the bootstrap intervals, Wilcoxon (`paired_stats`).
- rows.py: one record per paired doc and its passes: truncation, IFEval, the lenient filter's format split.
- compare.py: `bucket`, which runs them all into a `BucketReport`, with the pairing's notes and the test's power.
- protocol.py / noise.py: both runs' protocol records (`with_runs`), the noise floor of a repeat (`with_noise_floor`).
- render.py: a saved report as Markdown and CSV.
Resolving runs, hashing files and writing the output folder is the command's (commands/buckets.py). numpy/scipy
only, no file I/O here.
"""
