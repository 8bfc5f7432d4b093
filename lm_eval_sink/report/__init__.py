"""One self-contained HTML report per reference/candidate pair, from the project's own outputs.

`commands.report.load_inputs` reads and cross-checks the inputs, `view.build_view` (pure) turns them
into the template's context, `render.render_html` draws the figures and returns the HTML text, which
`commands.report.run_report` writes.
"""
