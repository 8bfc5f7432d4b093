"""One self-contained HTML report per reference/candidate pair, from the project's own outputs: read and checked by
`commands.report`, turned into the template's context by `view.build_view` (pure), drawn by `render.render_html`."""
