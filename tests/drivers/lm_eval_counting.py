"""Run the real lm_eval CLI entry point in this process, counting model loads.

Usage: python lm_eval_counting.py COUNT_FILE <lm_eval args...>
Writes the number of `PreTrainedModel.from_pretrained` calls to COUNT_FILE at exit, so a test can
prove that one `lm_eval --tasks a,b` call loads the model once.
"""

import atexit
import sys
from pathlib import Path

from transformers import modeling_utils

count_file = Path(sys.argv.pop(1))
loads = []
original = modeling_utils.PreTrainedModel.from_pretrained.__func__


@classmethod
def counting(cls, *args, **kwargs):
    loads.append(cls.__name__)
    return original(cls, *args, **kwargs)


modeling_utils.PreTrainedModel.from_pretrained = counting
atexit.register(lambda: count_file.write_text(str(len(loads))))
sys.argv[0] = "lm_eval"
from lm_eval.__main__ import cli_evaluate  # noqa: E402  (imported after the patch on purpose)

cli_evaluate()
