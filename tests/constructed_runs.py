"""lm-eval 0.4.13 run files built in tests with chosen per-prompt outcomes.

The layout and keys are those of real `results_<time>.json` / `samples_<task>_<time>.jsonl`
files (checked against runs of lm-eval 0.4.13 on SmolLM2); the numbers are set by the test so
that expected gaps and splits are exact. Used where real runs cannot give a known answer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

TS = "2026-12-01T10-00-00.000000"

_IFEVAL_METRICS = ["prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc"]
_GSM_FILTERS = [
    {
        "name": "strict-match",
        "filter": [
            {"function": "regex", "regex_pattern": "The answer is (\\-?[0-9\\.\\,]+)."},
            {"function": "take_first"},
        ],
    },
    {
        "name": "flexible-extract",
        "filter": [
            {"function": "regex", "group_select": -1, "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)"},
            {"function": "take_first"},
        ],
    },
]


def _h(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def task_config(task: str, num_fewshot: int, max_gen_toks: int = 64) -> dict[str, Any]:
    """A `configs[task]` block shaped like lm-eval's for ifeval / gsm8k-style tasks."""
    if task == "ifeval":
        return {
            "task": "ifeval",
            "dataset_path": "google/IFEval",
            "test_split": "train",
            "doc_to_text": "prompt",
            "doc_to_target": 0,
            "process_results": "def process_results(doc, results): ...",
            "description": "",
            "target_delimiter": " ",
            "fewshot_delimiter": "\n\n",
            "fewshot_config": {"sampler": "default", "split": None},
            "num_fewshot": num_fewshot,
            "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in _IFEVAL_METRICS],
            "output_type": "generate_until",
            "generation_kwargs": {"until": [], "do_sample": False, "temperature": 0.0, "max_gen_toks": max_gen_toks},
            "repeats": 1,
            "should_decontaminate": False,
            "metadata": {"version": 4.0},
        }
    return {
        "task": task,
        "dataset_path": "openai/gsm8k",
        "dataset_name": "main",
        "training_split": "train",
        "test_split": "test",
        "fewshot_split": "train",
        "doc_to_text": "Q: {{question}}\nA: Let's think step by step.",
        "doc_to_target": "{{answer}}",
        "description": "",
        "target_delimiter": " ",
        "fewshot_delimiter": "\n\n",
        "fewshot_config": {"sampler": "first_n", "split": "train"},
        "num_fewshot": num_fewshot,
        "metric_list": [
            {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True, "ignore_case": True}
        ],
        "output_type": "generate_until",
        "generation_kwargs": {"until": ["Q:", "</s>", "<|im_end|>"], "do_sample": False, "max_gen_toks": max_gen_toks},
        "repeats": 1,
        "filter_list": _GSM_FILTERS,
        "should_decontaminate": False,
        "metadata": {"version": 3.0},
    }


def results_dict(
    tasks: dict[str, dict[str, float]],
    *,
    model: str = "/models/ref",
    chat: bool = True,
    num_fewshot: dict[str, int] | None = None,
    batch_size: int = 8,
    limit: float | None = 5.0,
    system_instruction: str | None = None,
    model_args: dict[str, Any] | None = None,
    max_gen_toks: int | None = 64,  # None: no --gen_kwargs, the task's own length (IFEval's 1,280)
    template: str = "{% for m in messages %}{{ m['content'] }}{% endfor %}",
) -> dict[str, Any]:
    """A results JSON with the given `results[task]` metric values ("metric,filter" keys)."""
    nf = {t: (num_fewshot or {}).get(t, 0) for t in tasks}
    return {
        "results": {t: {"name": t, "alias": t, "sample_len": 5, **vals} for t, vals in tasks.items()},
        "group_subtasks": {},
        "configs": {t: task_config(t, nf[t], max_gen_toks or 1280) for t in tasks},
        "versions": {t: (4.0 if t == "ifeval" else 3.0) for t in tasks},
        "n-shot": nf,
        "higher_is_better": {t: {} for t in tasks},
        "n-samples": {t: {"original": 100, "effective": 5} for t in tasks},
        "config": {
            "model": "hf",
            "model_args": {"pretrained": model, **(model_args or {})},
            "model_num_parameters": 1000,
            "model_dtype": "torch.bfloat16",
            "model_revision": "main",
            "model_sha": "",
            "batch_size": str(batch_size),
            "batch_sizes": [],
            "device": "cpu",
            "use_cache": None,
            "limit": limit,
            "bootstrap_iters": 100000,
            "gen_kwargs": {"max_gen_toks": max_gen_toks} if max_gen_toks else None,
            "random_seed": 0,
            "numpy_seed": 1234,
            "torch_seed": 1234,
            "fewshot_seed": 1234,
        },
        "git_hash": None,
        "date": 1796282025.0,
        "transformers_version": "5.24.0",
        "lm_eval_version": "0.4.13",
        "tokenizer_pad_token": ["<|im_end|>", "2"],
        "tokenizer_eos_token": ["<|im_end|>", "2"],
        "tokenizer_bos_token": ["<|im_start|>", "1"],
        "eot_token_id": 2,
        "max_length": 8192,
        "task_hashes": {t: _h(t) for t in tasks},
        "model_source": "hf",
        "model_name": model,
        "model_name_sanitized": model.replace("/", "__"),
        "system_instruction": system_instruction,
        "system_instruction_sha": _h(system_instruction) if system_instruction else None,
        "fewshot_as_multiturn": True if chat else None,
        "chat_template": template if chat else None,
        "chat_template_sha": _h(template) if chat else None,
    }


def _doc(task: str, i: int) -> dict[str, Any]:
    if task == "ifeval":
        return {
            "key": 1000 + i,
            "prompt": f"Write {i} words in lowercase.",
            "instruction_id_list": ["change_case:english_lowercase"],
            "kwargs": [{}],
        }
    return {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}


def samples_lines(
    task: str, strict: list[int], lenient: list[int], prompt_tag: str = "", docs_offset: int = 0
) -> list[dict[str, Any]]:
    """Sample lines for per-doc outcomes: IFEval one line per doc (strict/loose prompt-level),
    GSM8K-style two lines per doc (strict-match / flexible-extract exact_match)."""
    rows = []
    for i, (s, l) in enumerate(zip(strict, lenient, strict=True)):
        doc = _doc(task, i + docs_offset)
        prompt = f"{prompt_tag}{doc.get('prompt') or doc['question']}"
        base = {
            "doc_id": i,
            "doc": doc,
            "target": 0 if task == "ifeval" else doc["answer"],
            "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": {"max_gen_toks": 64}}},
            "resps": [["answer"]],
            "doc_hash": _h(json.dumps(doc, indent=2, ensure_ascii=False)),
            "prompt_hash": _h(prompt),
            "target_hash": _h(str(doc.get("answer", 0))),
        }
        if task == "ifeval":
            rows.append(
                {
                    **base,
                    "filtered_resps": ["answer"],
                    "filter": "none",
                    "metrics": _IFEVAL_METRICS,
                    "prompt_level_strict_acc": bool(s),
                    "inst_level_strict_acc": [bool(s)],
                    "prompt_level_loose_acc": bool(l),
                    "inst_level_loose_acc": [bool(l)],
                }
            )
        else:
            rows.append(
                {
                    **base,
                    "filtered_resps": ["[invalid]"],
                    "filter": "strict-match",
                    "metrics": ["exact_match"],
                    "exact_match": float(s),
                }
            )
            rows.append(
                {
                    **base,
                    "filtered_resps": ["[invalid]"],
                    "filter": "flexible-extract",
                    "metrics": ["exact_match"],
                    "exact_match": float(l),
                }
            )
    return rows


def metric_values(task: str, strict: list[int], lenient: list[int]) -> dict[str, float]:
    n = len(strict)
    if task == "ifeval":
        return {
            "prompt_level_strict_acc,none": sum(strict) / n,
            "prompt_level_loose_acc,none": sum(lenient) / n,
            "inst_level_strict_acc,none": sum(strict) / n,
            "inst_level_loose_acc,none": sum(lenient) / n,
        }
    return {"exact_match,strict-match": sum(strict) / n, "exact_match,flexible-extract": sum(lenient) / n}


def write_run(
    folder: Path,
    outcomes: dict[str, tuple[list[int], list[int]]],
    *,
    samples: bool = True,
    prompt_tag: str = "",
    ts: str = TS,
    **kw: Any,
) -> Path:
    """Write `<folder>/results_<ts>.json` (+ samples) for per-task (strict, lenient) outcomes; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    res = results_dict({t: metric_values(t, s, l) for t, (s, l) in outcomes.items()}, **kw)
    path = folder / f"results_{ts}.json"
    path.write_text(json.dumps(res, indent=2), encoding="utf-8")
    if samples:
        for t, (s, l) in outcomes.items():
            lines = samples_lines(t, s, l, prompt_tag=prompt_tag)
            (folder / f"samples_{t}_{ts}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8"
            )
    return path
