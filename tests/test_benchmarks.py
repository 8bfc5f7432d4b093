"""The one task table (data/benchmarks.yaml) that buckets and attribute read."""

from __future__ import annotations

import pytest

from lm_eval_sink.benchmarks import benchmark_of, ifeval_instructions, load_benchmarks
from lm_eval_sink.errors import UserError


def test_one_entry_serves_both_commands():
    b = load_benchmarks()
    gsm = benchmark_of("gsm8k_cot_zeroshot", b)
    assert (gsm.metric, gsm.filter, gsm.lenient_filter, gsm.kind) == (
        "exact_match",
        "strict-match",
        "flexible-extract",
        "binary",
    )
    assert (gsm.strict, gsm.lenient, gsm.construct) == (
        "exact_match,strict-match",
        "exact_match,flexible-extract",
        "procedure",
    )
    ife = benchmark_of("ifeval", b)
    assert (ife.metric, ife.filter, ife.checker) == ("prompt_level_strict_acc", "none", "ifeval")
    assert ife.lenient_filter is None  # the loose score is another metric, not a lenient filter of the strict one
    assert ife.instruction_metrics["prompt_level_loose_acc"] == "inst_level_loose_acc"
    assert benchmark_of("eq_bench", b).kind == "continuous"
    assert benchmark_of("gsm8k_cot", b).name == benchmark_of("gsm8k_cot_self_consistency", b).name == "GSM8K"
    # GPQA: the diamond CoT family by its longer pattern, other GPQA CoT / generative tasks by the general one
    assert benchmark_of("gpqa_diamond_cot_zeroshot", b).name == "GPQA-Diamond-CoT"
    assert (
        benchmark_of("gpqa_main_cot_n_shot", b).name == benchmark_of("gpqa_diamond_generative_n_shot", b).name == "GPQA"
    )
    assert all(
        "--seed" in benchmark_of(t, b).doc_mismatch_hint for t in ("gpqa_diamond_cot_zeroshot", "gpqa_main_cot_n_shot")
    )
    assert benchmark_of(None, b) is None
    assert ifeval_instructions()["punctuation:no_comma"] == {"kind": "format", "truncation": "never"}


def test_user_file_adds_and_replaces_families(tmp_path):
    f = tmp_path / "b.yaml"
    f.write_text(
        "benchmarks:\n  GSM8K:\n    tasks: [gsm8k_cot_zeroshot]\n    construct: procedure\n    "
        "strict: exact_match,flexible-extract\n"
        "  Mine:\n    tasks: [my_task]\n    construct: format\n    strict: score,none\n    kind: continuous\n"
    )
    b = load_benchmarks(f)
    assert (
        benchmark_of("gsm8k_cot_zeroshot", b).filter == "flexible-extract"
        and benchmark_of("gsm8k_cot_zeroshot", b).lenient is None
    )
    assert benchmark_of("my_task", b).kind == "continuous"
    assert load_benchmarks()["GSM8K"].filter == "strict-match"  # the bundled table is not changed by a user file


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "benchmarks:\n  X: {tasks: [t], construct: format, strict: 'a,none', knd: binary}\n",
            "unknown key 'knd' (did you mean 'kind'?)",
        ),
        ("benchmarks:\n  X: {tasks: [t], construct: format, strict: 'a,none', kind: ordinal}\n", "has kind 'ordinal'"),
        (
            "benchmarks:\n  X: {tasks: [t], construct: format, strict: 'a,none', checker: ifevl}\n",
            "has checker 'ifevl'",
        ),
        ("benchmarks:\n  X: {tasks: [t], construct: format, strict: acc}\n", "is not 'metric,filter'"),
        ("benchmarks:\n  X: {tasks: [t], construct: format}\n", "lacks `strict`"),
        (
            "benchmarks:\n  X: {tasks: [t], construct: format, strict: 'a,none'}\nifeval_instructions: {}\n",
            "unknown key 'ifeval_instructions'",
        ),
        (
            "benchmarks:\n  X: {tasks: [t], construct: format, strict: 'a,none', instruction_metrics: [a]}\n",
            "instruction_metrics must map",
        ),
        ("benchmarks: [\n", "not valid YAML"),
    ],
)
def test_bad_user_file_is_one_clear_error(tmp_path, text, message):
    f = tmp_path / "b.yaml"
    f.write_text(text)
    with pytest.raises(UserError) as e:
        load_benchmarks(f)
    assert message in e.value.message and str(f) in e.value.message
