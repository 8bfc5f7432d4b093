"""Hand-made lm-eval runs for the buckets tests and benchmark, scored by lm-eval's own code.

Samples lines have the exact shape lm-eval 0.4.13 writes with --log_samples (doc_id, doc, target,
arguments.gen_args_0.{arg_0, arg_1}, resps, filtered_resps, filter, metrics, doc/prompt/target
hashes, metric values), and the metric values come from lm-eval itself: IFEval through
`lm_eval.tasks.ifeval.utils.process_results` (the real checker), GSM8K-CoT through the task's real
regex filters and `exact_match`, EQ-Bench through its `calculate_score_fullscale`. Only the
responses are written by hand. `write_run` lays files out as lm-eval does
(`<out>/<model>/results_<ts>.json` + `samples_<task>_<ts>.jsonl`).
"""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Any

import yaml
from constructed_runs import TS, _h

LM_EVAL_TASKS = Path(__import__("lm_eval").__file__).parent / "tasks"
SYSTEM_CHAT = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


@contextlib.contextmanager
def seeded_checker():
    """langdetect and (for letter_frequency with a non-letter) `random` make lm-eval's IFEval
    checker nondeterministic: seed both so the hand-made logs are reproducible."""
    from langdetect import DetectorFactory

    old, state = DetectorFactory.seed, random.getstate()
    DetectorFactory.seed = 0
    random.seed(0)
    try:
        yield
    finally:
        DetectorFactory.seed = old
        random.setstate(state)


def sample_line(
    doc_id: int,
    doc: dict,
    target: Any,
    prompt: str,
    gen_kwargs: dict,
    response: str,
    filtered: str,
    filt: str,
    metrics: dict[str, Any],
) -> dict:
    """One samples line as lm-eval's evaluator + EvaluationTracker write it."""
    line = {
        "doc_id": doc_id,
        "doc": doc,
        "target": str(target),
        "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": gen_kwargs}},
        "resps": [[response]],
        "filtered_resps": [filtered],
        "filter": filt,
        "metrics": list(metrics),
        "doc_hash": _h(json.dumps(doc, indent=2, ensure_ascii=False)),
        "prompt_hash": _h(prompt),
        "target_hash": _h(str(target)),
    }
    line.update(metrics)
    return line


# --- IFEval ----------------------------------------------------------------------------------------

IFEVAL_GEN = {"until": [], "do_sample": False, "temperature": 0.0, "max_gen_toks": 64}


def ifeval_docs(shared_data: Path) -> list[dict]:
    return read_jsonl(shared_data / "ifeval" / "input_data.jsonl")


def ifeval_sample(doc_id: int, doc: dict, response: str, gen_kwargs: dict | None = None, chat: bool = False) -> dict:
    from lm_eval.tasks.ifeval import utils

    with seeded_checker():
        metrics = utils.process_results(doc, [response])
    prompt = SYSTEM_CHAT.format(prompt=doc["prompt"]) if chat else doc["prompt"]
    return sample_line(doc_id, doc, 0, prompt, dict(gen_kwargs or IFEVAL_GEN), response, response, "none", metrics)


# Designed responses for single-instruction IFEval prompts: (instruction id) -> {variant: text}.
# `pass` follows the instruction; the other variants break it in a known way.
_BODY = "Here is my answer to the question and I hope it helps you today."
TRUNCATED = "Here is my answer to the question and it keeps going on and on about the topic until the text is cut"
DESIGNED = {
    "punctuation:no_comma": {"pass": _BODY, "fail": "Here is my answer, and I hope it helps you today."},
    "startend:end_checker": {"pass": _BODY + " {end_phrase}", "fail": _BODY, "truncated": TRUNCATED},
    "detectable_content:postscript": {"pass": _BODY + "\n\n{postscript_marker} Thanks for reading.", "fail": _BODY},
    "change_case:english_lowercase": {
        "pass": "here is my answer to the question and i hope it helps you today.",
        "fail": _BODY,
    },
    "startend:quotation": {"pass": '"' + _BODY + '"', "fail": _BODY},
    "detectable_format:title": {"pass": "<<My Answer>>\n" + _BODY, "fail": _BODY},
    "language:response_language": {
        "pass": "이것은 한국어로 작성된 답변입니다. 여러 문장을 써서 언어가 정확하게 감지되도록 합니다.",
        "fail": _BODY,
    },
    "detectable_format:json_format": {"pass": '{"answer": "Here is my answer."}', "fail": "answer: yes"},
}


def designed_response(doc: dict, variant: str) -> str:
    (iid,) = doc["instruction_id_list"]
    text = DESIGNED[iid][variant]
    for k, v in doc["kwargs"][0].items():
        text = text.replace("{" + k + "}", str(v))
    return text


def find_single(docs: list[dict], iid: str, n: int, **kwargs: Any) -> list[int]:
    """Indices of the first `n` docs whose only instruction is `iid` (with those kwargs)."""
    out = [
        i
        for i, d in enumerate(docs)
        if d["instruction_id_list"] == [iid] and all(d["kwargs"][0].get(k) == v for k, v in kwargs.items())
    ]
    if len(out) < n:
        raise ValueError(f"only {len(out)} docs with the single instruction {iid}")
    return out[:n]


# --- GSM8K-CoT ------------------------------------------------------------------------------------


def _gsm8k_config() -> dict:
    return yaml.safe_load((LM_EVAL_TASKS / "gsm8k" / "gsm8k-cot-zeroshot.yaml").read_text())


def gsm8k_docs(shared_data: Path) -> list[dict]:
    return read_jsonl(shared_data / "gsm8k" / "test.jsonl")


def gsm8k_answer(doc: dict) -> str:
    return doc["answer"].split("####")[-1].strip()


def gsm8k_samples(
    doc_id: int, doc: dict, response: str, gen_kwargs: dict | None = None, chat: bool = False
) -> list[dict]:
    """One line per filter (strict-match, flexible-extract), scored by lm-eval's regex filters and exact_match."""
    from lm_eval.filters.extraction import RegexFilter

    try:
        from lm_eval.api.metrics import exact_match_hf_evaluate
    except ImportError:  # lm-eval 0.5: a list of 0/1 per prediction
        from lm_eval.api.metrics.generation import _exact_match_hf_evaluate as exact_match_hf_evaluate

    cfg = _gsm8k_config()
    metric = dict(cfg["metric_list"][0])
    for k in ("metric", "aggregation", "higher_is_better"):
        metric.pop(k)
    gen = dict(gen_kwargs or cfg["generation_kwargs"])
    text = f"Q: {doc['question']}\nA: Let's think step by step."
    prompt = SYSTEM_CHAT.format(prompt=text) if chat else text
    lines = []
    for f in cfg["filter_list"]:
        regex = f["filter"][0]
        extract = RegexFilter(regex_pattern=regex["regex_pattern"], group_select=regex.get("group_select", 0))
        filtered = next(iter(extract.apply([[response]], [doc])))[0]  # a list on 0.4.13, a generator on 0.5
        match = exact_match_hf_evaluate(predictions=[filtered], references=[doc["answer"]], **metric)["exact_match"]
        score = float(sum(match) / len(match) if isinstance(match, list) else match)
        lines.append(
            sample_line(doc_id, doc, doc["answer"], prompt, gen, response, filtered, f["name"], {"exact_match": score})
        )
    return lines


def gsm8k_response(doc: dict, variant: str) -> str:
    """right: strict and flexible right; format: only flexible right; wrong: both wrong."""
    ans = gsm8k_answer(doc).replace(",", "")
    if variant == "right":
        return f"We add and subtract the amounts step by step. The answer is {ans}."
    if variant == "format":
        return f"We add and subtract the amounts step by step. So the result is {ans}"
    return f"We add and subtract the amounts step by step. The answer is {int(float(ans)) + 1}."


# --- EQ-Bench -------------------------------------------------------------------------------------


def eqbench_docs(shared_data: Path) -> list[dict]:
    return read_jsonl(shared_data / "eq_bench" / "validation.jsonl")


def eqbench_sample(doc_id: int, doc: dict, scores: list[int] | None) -> dict:
    """A response giving `scores` to the doc's four emotions in order (None: unparseable)."""
    import ast

    from lm_eval.tasks.eq_bench.utils import calculate_score_fullscale

    ref = ast.literal_eval(doc["reference_answer_fullscale"])
    if scores is None:
        response = "I cannot tell how they feel."
    else:
        response = "Revised scores:\n" + "\n".join(f"{ref[f'emotion{k + 1}']}: {s}" for k, s in enumerate(scores))
    with contextlib.redirect_stdout(None):
        metrics = calculate_score_fullscale(doc, [response])
    return sample_line(
        doc_id,
        doc,
        doc["reference_answer_fullscale"],
        doc["prompt"],
        {"do_sample": False, "temperature": 0.0, "max_gen_toks": 80},
        response,
        response,
        "none",
        metrics,
    )


# --- runs on disk ---------------------------------------------------------------------------------


def results_json(task_samples: dict[str, list[dict]], *, model: str, chat_template: bool, limit: float | None) -> dict:
    """A results_<ts>.json with the keys lm-eval 0.4.13 writes (those the tools read, with real values)."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        if chat_template
        else None
    )
    configs = {}
    for task, lines in task_samples.items():
        configs[task] = {
            "task": task,
            "num_fewshot": 0,
            "generation_kwargs": lines[0]["arguments"]["gen_args_0"]["arg_1"],
            "metadata": {"version": 1.0},
        }
    return {
        "results": {t: {"alias": t} for t in task_samples},
        "configs": configs,
        "versions": {t: 1.0 for t in task_samples},
        "n-shot": {t: 0 for t in task_samples},
        "config": {
            "model": "hf",
            "model_args": {"pretrained": model, "dtype": "float32"},
            "model_dtype": "torch.float32",
            "model_sha": "",
            "batch_size": "1",
            "device": "cpu",
            "limit": limit,
            "gen_kwargs": {},
            "random_seed": 0,
            "numpy_seed": 1234,
            "torch_seed": 1234,
            "fewshot_seed": 1234,
        },
        "lm_eval_version": "0.4.13",
        "transformers_version": "5.24.0",
        "model_name": model,
        "chat_template": template,
        "chat_template_sha": _h(template) if template else None,
        "system_instruction": None,
        "system_instruction_sha": None,
        "fewshot_as_multiturn": bool(chat_template),
        "task_hashes": {
            t: _h("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in lines))
            for t, lines in task_samples.items()
        },
    }


def write_run(
    out: Path,
    task_samples: dict[str, list[dict]],
    *,
    model: str = "test-model",
    chat_template: bool = True,
    limit: float | None = None,
) -> Path:
    """Write one run as lm-eval lays it out; returns the model folder."""
    folder = Path(out) / model.replace("/", "__")
    folder.mkdir(parents=True, exist_ok=True)
    res = results_json(task_samples, model=model, chat_template=chat_template, limit=limit)
    (folder / f"results_{TS}.json").write_text(json.dumps(res, indent=2, ensure_ascii=False), encoding="utf-8")
    for task, lines in task_samples.items():
        with open(folder / f"samples_{task}_{TS}.jsonl", "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return folder


# --- realistic full-size logs for the benchmark ---------------------------------------------------

_WORDS = (
    "the plan works because each step builds on the last one and keeps the reader focused on what matters most "
    "we start with a clear goal then we gather the facts and finally we check every result against the goal"
).split()


def _sentences(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 16))).capitalize() + "." for _ in range(n)]


def build_response(doc: dict, rng: random.Random, n_sentences: int = 12) -> str:
    """A plausible response that tries to follow the doc's instructions (many types, not all)."""
    ids = doc["instruction_id_list"]
    kws = [{k: v for k, v in kw.items() if v is not None} for kw in doc["kwargs"]]
    paras = [" ".join(_sentences(rng, max(1, n_sentences // 3))) for _ in range(3)]
    prefix, suffix, sep = [], [], "\n\n"
    for iid, kw in zip(ids, kws, strict=True):
        if iid == "keywords:existence":
            paras[0] += " " + " ".join(kw["keywords"]) + "."
        elif iid == "keywords:frequency" and kw.get("relation") == "at least":
            paras[-1] += " " + " ".join([kw["keyword"]] * (kw["frequency"] + 1)) + "."
        elif iid == "length_constraints:number_paragraphs":
            paras = [" ".join(_sentences(rng, 2)) for _ in range(kw["num_paragraphs"])]
            sep = "\n\n***\n\n"
        elif iid == "length_constraints:number_words" and kw.get("relation") == "at least":
            while sum(len(p.split()) for p in paras) < kw["num_words"] + 5:
                paras.append(" ".join(_sentences(rng, 4)))
        elif iid == "detectable_format:number_highlighted_sections":
            paras[0] += " " + " ".join(f"*highlighted part {k + 1}*" for k in range(kw["num_highlights"]))
        elif iid == "detectable_format:number_bullet_lists":
            paras.insert(1, "\n".join(f"* point {k + 1} of the list" for k in range(kw["num_bullets"])))
        elif iid == "detectable_content:number_placeholders":
            paras[0] += " " + " ".join(f"[place {k}]" for k in range(kw["num_placeholders"]))
        elif iid == "detectable_format:multiple_sections":
            paras = [
                f"{kw['section_spliter']} {k + 1}\n" + " ".join(_sentences(rng, 2)) for k in range(kw["num_sections"])
            ]
        elif iid == "combination:repeat_prompt":
            prefix.append(kw["prompt_to_repeat"])
        elif iid == "detectable_format:title":
            prefix.append("<<A Short Title>>")
        elif iid == "detectable_content:postscript":
            suffix.append(f"{kw['postscript_marker']} Thank you for reading.")
        elif iid == "startend:end_checker":
            suffix.append(kw["end_phrase"])
        elif iid == "detectable_format:constrained_response":
            paras = ["My answer is yes."]
        elif iid == "combination:two_responses":
            paras = [paras[0], "******", paras[-1]]
    text = "\n\n".join([*prefix, sep.join(paras), *suffix])
    if "change_case:english_lowercase" in ids:
        text = text.lower()
    if "change_case:english_capital" in ids:
        text = text.upper()
    if "punctuation:no_comma" in ids:
        text = text.replace(",", "")
    if "startend:quotation" in ids:
        text = f'"{text}"'
    if "detectable_format:json_format" in ids:
        text = json.dumps({"answer": text})
    return text


def perturb(text: str, rng: random.Random, limit_bytes: int) -> str:
    """A candidate-side change of a reference response: cut, lose the ending, add commas, recase."""
    r = rng.random()
    if r < 0.3:
        cut = text[: max(20, min(len(text) - 1, limit_bytes))]
        return cut.rstrip(" .!?\"'}") or cut
    if r < 0.5:
        return text.rsplit("\n\n", 1)[0]
    if r < 0.7:
        return text.replace(" and ", ", and ", 3)
    if r < 0.85:
        return text.title()
    return text[:2000]
