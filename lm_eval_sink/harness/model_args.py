"""One reading of a boolean model argument (`--model_args trust_remote_code=...,parallelize=...`)."""

from __future__ import annotations

from typing import Any


def model_arg_flag(value: Any) -> bool:
    """Whether a boolean model argument is on, as the model class that receives it from lm-eval takes it.

    lm-eval parses each `--model_args` value (`lm_eval.utils.handle_arg_string`): "true"/"false" in any case
    become booleans, "none" None, digits an int, other numbers a float, a quoted value the string inside
    the quotes, anything else stays a string. HFLM then tests `parallelize` by truthiness, and transformers
    (`resolve_trust_remote_code`) and vLLM do the same with `trust_remote_code`. So "1", "yes", "True" and
    "true" are on; "0", "0.0", "false", "False", "none" and "" are off; and "no" is on, as it is for lm-eval
    (a non-empty string). A value that is not a string (a protocol YAML's `true`, or lm-eval's own parse)
    is read by truthiness too.
    """
    if not isinstance(value, str):
        return bool(value)
    text = value.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return bool(text[1:-1])
    if text.lower() in ("true", "false", "none"):
        return text.lower() == "true"
    try:
        return float(text) != 0  # ints and floats alike; "nan" is truthy, as lm-eval's float is
    except ValueError:
        return bool(text)
