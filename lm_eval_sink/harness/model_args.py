"""One reading of `--model_args`: the arguments as lm-eval parses them, a boolean one as its model class takes it."""

from __future__ import annotations

from typing import Any


def model_arg_flag(value: Any) -> bool:
    """Whether a boolean model argument is on, as the model class that receives it from lm-eval takes it: lm-eval's
    parse (`lm_eval.utils.handle_arg_string`), then truthiness, as HFLM, transformers and vLLM test it ("no" is on, a
    non-empty string; "0", "false", "none", "" are off)."""
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


def parsed_model_args(model_args: Any) -> dict[str, Any]:
    """`--model_args` as lm-eval parses them (a string: `simple_parse_args_string`; a dict or None: a copy)."""
    from lm_eval.utils import simple_parse_args_string

    return simple_parse_args_string(model_args) if isinstance(model_args, str) else dict(model_args or {})
