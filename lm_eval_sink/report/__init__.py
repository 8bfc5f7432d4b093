"""One self-contained HTML report per reference/candidate pair, from the project's own outputs.

`load.load_inputs` reads and cross-checks the inputs, `view.build_view` (pure) turns them into the
template's context, `render.write_report` draws the figures and writes the HTML.
"""
