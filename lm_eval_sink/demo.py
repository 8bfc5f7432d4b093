"""`make demo`: the mission's command on the embedded default model, then where everything is.

This module only parses the options of `python -m lm_eval_sink.demo` and prints; the run is
commands/demo.py's `run_demo`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lm_eval_sink.commands.demo import DEMO_LIMIT, DEMO_MAX_GEN_TOKS, run_demo
from lm_eval_sink.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lm_eval_sink.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("demo_out"))
    parser.add_argument("--limit", type=int, default=DEMO_LIMIT)
    parser.add_argument("--max-gen-toks", type=int, default=DEMO_MAX_GEN_TOKS)
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
