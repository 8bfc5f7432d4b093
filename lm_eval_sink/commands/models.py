"""`lm-eval-sink models convert`: a GGUF file as a model folder (`models.convert_gguf`), for the commands that read a
folder's files (merges, sweeps, extraction, `eval`)."""

from __future__ import annotations

from pathlib import Path

from lm_eval_sink.errors import UserError


def run_models_convert(gguf: Path, out: Path, force: bool = False) -> list[str]:
    """The `models convert` command: check the file and OUT_DIR before any work, convert; the line to print."""
    from lm_eval_sink.outputs import check_output_dir
    from lm_eval_sink.models import check_gguf, convert_gguf, is_gguf

    gguf, out = Path(gguf).expanduser(), Path(out).expanduser()
    if not gguf.is_file() or not is_gguf(gguf):
        raise UserError(f"{gguf}: not a GGUF file", "pass a .gguf file written by llama.cpp's tools")
    check_gguf(gguf)
    check_output_dir(out, force, "OUT_DIR", inputs=[gguf])
    marker = convert_gguf(gguf.resolve(), out, force=force)
    return [f"{gguf.name} ({marker['gguf_quantization']['file_type']}, dequantized to float32) -> {out}"]
