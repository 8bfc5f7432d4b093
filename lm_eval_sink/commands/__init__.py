"""The command side of each subcommand: input resolution, output folders, provenance, reports.

One module per subcommand (`commands/<subcommand>.py`); cli.py parses options and calls its
`run_<subcommand>(...)`, which returns the lines to print. A command module resolves its inputs (runs, models,
files), calls the pure core (buckets/, attribution.py, margin.py, predict.py, strength.py, screen.py,
training/protection.py,
report/view.py), which takes and returns data, then writes: several files into one output folder
(`outputs.check_output_dir` before any work, `outputs.staged_dir` at the end), one file with `outputs.check_new_outputs`
and `io.atomic_write_*`. Both checks take the command's `inputs=` (required): an output that is, holds or
lies inside an input is refused even with --force (`outputs.check_not_inputs`, which strength, screen and sweep
call before they lock their folder), and both refuse an output that cannot be written (`outputs.check_writable`).
Every check of arguments, interpreters and outputs runs before a model is converted or loaded: a command names
its models with `models.resolve_model(..., convert=False)` for the checks and resolves them again after.
Tables come from tables.py, provenance from provenance.provenance.
"""
