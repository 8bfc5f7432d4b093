"""Run several `lm_eval_sink.cli.main` calls in this one interpreter (imports paid once).

Usage: python cli_calls.py CALLS.json RESULT.json
CALLS.json is a list of [name, argv]; RESULT.json gets {"calls": {name: {rc, out, err, seconds}}, "modules":
{module: file}} with the file of every lm_eval_sink module imported, so a test can see where the
package came from. A call that raises records rc -1 and the traceback as err.
"""

import contextlib
import io
import json
import sys
import time
import traceback

from lm_eval_sink.cli import main

calls, result = json.load(open(sys.argv[1])), {}
for name, argv in calls:
    out, err, start = io.StringIO(), io.StringIO(), time.time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except BaseException:  # recorded for the test, which names the failing call
            rc = -1
            traceback.print_exc()
    result[name] = {"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "seconds": round(time.time() - start, 1)}
modules = {m: getattr(mod, "__file__", None) for m, mod in sys.modules.items() if m.split(".")[0] == "lm_eval_sink"}
json.dump({"calls": result, "modules": modules}, open(sys.argv[2], "w"), indent=1)
