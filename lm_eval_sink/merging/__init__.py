"""Post-VL merging controls: TSV/STAR methods for mergekit, bundled configs, validation, sweeps.

`methods` (tensor math + mergekit registration), `configs` (bundled configs, render, strict
validation), `merge` (validated in-process mergekit runs into verified folders), `sweep` (the
sweep's core: schema, units and their keys, the table; `commands/sweep.py` runs it), `engines`
(local or Ray). Importing this package imports neither torch nor mergekit.
"""
