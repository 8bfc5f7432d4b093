"""Post-VL merging controls: TSV/STAR methods for mergekit, bundled configs, validation, sweeps (docs/merging.md).

Importing this package imports neither torch nor mergekit.
"""
