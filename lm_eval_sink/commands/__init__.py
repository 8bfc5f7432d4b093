"""The command side of each subcommand: `commands/<subcommand>.py`'s `run_<subcommand>(...)` resolves the inputs,
calls the pure core, checks and writes the outputs and returns the lines cli.py prints (docs/development.md,
"Layering" and "Outputs")."""
