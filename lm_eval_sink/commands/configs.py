"""`lm-eval-sink configs render`: fill a bundled merge control for one model pair and write the mergekit YAML."""

from __future__ import annotations

from pathlib import Path


def run_configs_render(
    name: str,
    reference: str,
    candidate: str,
    output: Path,
    *,
    base: str | None = None,
    tokenizer_source: str | None = None,
    force: bool = False,
) -> tuple[list[str], list[str]]:
    """The `configs render` command: (warnings for stderr, lines to print)."""
    from lm_eval_sink.io import atomic_write_text
    from lm_eval_sink.outputs import new_files
    from lm_eval_sink.merging.configs import render

    output = Path(output)
    with new_files([output], force, "-o", inputs=[reference, candidate, base, tokenizer_source]):
        rendered = render(name, reference, candidate, base=base, tokenizer_source=tokenizer_source)
        atomic_write_text(output, rendered.text)
    return list(rendered.warnings), [f"{rendered.name} ({rendered.lineage} lineage: {rendered.formula}) -> {output}"]
