"""`make demo`: the mission's command on the embedded default model, then where everything is.

lm-eval with sink_strength and ifeval, the heatmap, S and IFEval (docs/lm-eval.md); the run's files are kept under
`<output>/<model folder name>/`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from lm_eval_sink.errors import UserError
from lm_eval_sink.runs import RunFiles, resolve_run


def run_demo(output: Path, limit: int, max_gen_toks: int) -> list[str]:
    """Run the demo and return the lines to print."""
    from lm_eval_sink.harness.runner import EvalSettings, check_interpreter, run_lm_eval
    from lm_eval_sink.outputs import check_writable
    from lm_eval_sink.models import default_model_dir
    from lm_eval_sink.plots import layer_head_heatmap
    from lm_eval_sink.runs import load_results

    settings = EvalSettings(
        tasks=("sink_strength", "ifeval"),
        apply_chat_template=True,
        limit=limit,
        gen_kwargs={"max_gen_toks": max_gen_toks},
    )
    check_interpreter(settings)  # before the model is converted, as is the output's place
    check_writable(Path(output))
    model = default_model_dir()
    run = _move_run(run_lm_eval(str(model), settings, output, echo=True), Path(output) / model.name)
    res = load_results(run)
    s = res["results"]["sink_strength"]
    ife = res["results"]["ifeval"]
    matrix = s["sink_strength_layer_head,none"]
    png = layer_head_heatmap(
        matrix["values"],
        matrix["layers"],
        f"SmolLM2-135M-Instruct: sink log-odds, S = {s['sink_strength,none']:.4f}",
        run.results.with_name(run.results.stem.replace("results_", "sink_strength_heatmap_") + ".png"),
    )
    return [
        f"model:                  {model}",
        f"Sink Strength S:        {s['sink_strength,none']:.4f} (last 10 layers, 15 prompts; "
        f"content rows {s['sink_strength_content_rows,none']:.4f}, "
        f"template rows {s['sink_strength_template_rows,none']:.4f})",
        f"position-0 share:       {s['pos0_argmax_fraction,none']:.3f} of rows, median mass "
        f"{s['pos0_mass_median,none']:.3f}",
        f"IFEval prompt strict:   {ife['prompt_level_strict_acc,none']:.3f}   loose: "
        f"{ife['prompt_level_loose_acc,none']:.3f}   (limit {limit}, max_gen_toks {max_gen_toks}: "
        "not a final score)",
        f"results:                {run.results}",
        f"samples:                {', '.join(str(p) for p in run.samples.values())}",
        f"heatmap:                {png}",
    ]


def _move_run(run: RunFiles, folder: Path) -> RunFiles:
    """The run's results and samples moved into `folder` (earlier runs there are kept: names carry the time)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in (run.results, *run.samples.values()):
        os.replace(f, folder / f.name)
    with contextlib.suppress(OSError):  # lm-eval's own folder, when nothing else is left in it
        run.results.parent.rmdir()
    return resolve_run(folder / run.results.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lm_eval_sink.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("demo_out"))
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-gen-toks", type=int, default=128)
    args = parser.parse_args(argv)
    try:
        lines = run_demo(args.output, args.limit, args.max_gen_toks)
    except UserError as e:
        print(f"error: {e.line()}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
