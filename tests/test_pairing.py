"""The one per-document pairing of two sample logs, as buckets and attribution both use it."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest

from lm_eval_sink.attribution import per_prompt_split
from lm_eval_sink.buckets.compare import bucket
from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.errors import UserError
from lm_eval_sink.pairing import doc_difference, index_docs, pair_docs


def _h(obj) -> str:
    return hashlib.sha256(json.dumps(obj, indent=2, ensure_ascii=False).encode()).hexdigest()


def _rows(n: int, outcomes: list[int] | None = None) -> list[dict]:
    rows = []
    for i in range(n):
        doc = {"question": f"q{i}", "answer": str(i)}
        rows.append(
            {
                "doc_id": i,
                "doc": doc,
                "doc_hash": _h(doc),
                "prompt_hash": _h(f"p{i}"),
                "target_hash": _h(str(i)),
                "filter": "none",
                "metrics": ["acc"],
                "acc": float((outcomes or [1] * n)[i]),
            }
        )
    return rows


def test_same_doc_rules():
    a, k2 = {"doc": {"k": 1, "x": None}, "doc_hash": "h1"}, {"doc": {"k": 2}, "doc_hash": "h2"}
    assert doc_difference(a, {"doc": {"k": 2}, "doc_hash": "h1"}) == (None, False)  # equal hashes decide
    assert doc_difference(a, {"doc": {"k": 1}, "doc_hash": "h2"}) == (None, True)  # differ only by a null field
    assert doc_difference(a, k2) == ("has different doc_hash: field 'k' differs: '1' vs '2'", False)
    assert doc_difference(a, {"doc_hash": "h2"}) == ("has different doc_hash and a doc is missing", False)
    # equal docs under two hashes: the hashes are not of these docs; a missing hash: the docs decide
    why = "has different doc_hash although the logged docs are equal (the hashes were not computed from these docs)"
    assert doc_difference({"doc": {"k": 1}, "doc_hash": "h1"}, {**k2, "doc": {"k": 1}}) == (why, False)
    assert doc_difference({"doc": {"k": 1}}, {"doc": {"k": 1}, "doc_hash": "h2"}) == (None, False)


def test_both_commands_refuse_the_same_logs_with_the_same_message():
    ref = _rows(6)
    swapped = copy.deepcopy(ref)
    swapped[2]["doc"] = {"question": "other", "answer": "2"}
    swapped[2]["doc_hash"] = _h(swapped[2]["doc"])
    msgs = []
    for call in (
        lambda c: bucket(ref, c, "boolq", BucketSettings(n_bootstrap=100)),
        lambda c: per_prompt_split(
            ref, c, "acc,none", None, ref_where="reference samples", cand_where="candidate samples"
        ),
    ):
        with pytest.raises(UserError) as e:
            call(swapped)
        msgs.append(e.value.line())
    assert msgs[0] == msgs[1]
    assert (
        "1 of 6 paired doc_ids hold different documents in the two runs (e.g. doc_id 2 has "
        "different doc_hash: field 'question' differs" in msgs[0]
    )


def test_partial_pairing_only_when_asked_and_recorded():
    ref, cand = _rows(6, [1, 1, 0, 1, 0, 1]), _rows(4, [1, 0, 0, 1])
    with pytest.raises(UserError, match="2 doc_ids only in the reference, 0 only in the candidate"):
        pair_docs(index_docs(ref, "none", "r"), index_docs(cand, "none", "c"))
    ids, info = pair_docs(index_docs(ref, "none", "r"), index_docs(cand, "none", "c"), allow_partial=True)
    assert ids == [0, 1, 2, 3] and info["dropped_reference_only"] == [4, 5] and info["n_paired"] == 4
    rep = bucket(ref, cand, "boolq", BucketSettings(n_bootstrap=100, allow_partial=True))
    pp = per_prompt_split(ref, cand, "acc,none", None, allow_partial=True)
    assert rep.n == pp["n"] == 4 and pp["dropped"] == {"reference_only": 2, "candidate_only": 0}
    assert rep.delta * 100 == pytest.approx(pp["gap"]) == -25.0


def test_prompt_hash_differences_are_counted_not_refused():
    ref = _rows(3)
    cand = copy.deepcopy(ref)
    for r in cand:
        r["prompt_hash"] = _h("templated " + r["prompt_hash"])
    _, info = pair_docs(index_docs(ref, "none", "r"), index_docs(cand, "none", "c"))
    assert info["prompt_hash_differs"] == {"count": 3, "examples": [0, 1, 2]}
    assert per_prompt_split(ref, cand, "acc,none", None)["prompt_hash_differs"] == 3


def test_index_rejects_bad_doc_ids_and_missing_filters():
    rows = _rows(2)
    with pytest.raises(UserError, match="is not an integer"):
        index_docs([{**rows[0], "doc_id": "0"}], "none", "r")
    with pytest.raises(UserError, match="appears twice under filter 'none'"):
        index_docs(rows + rows[:1], "none", "r")
    with pytest.raises(UserError, match=r"no samples under filter 'strict-match' \(filters present: none\)"):
        index_docs(rows, "strict-match", "r")


def test_lenient_filter_must_cover_the_paired_docs():
    def gsm(n_flexible: int) -> list[dict]:
        out = []
        for r in _rows(3):
            out.append({**r, "filter": "strict-match", "metrics": ["exact_match"], "exact_match": 1.0})
            if r["doc_id"] < n_flexible:
                out.append({**r, "filter": "flexible-extract", "metrics": ["exact_match"], "exact_match": 1.0})
        return out

    with pytest.raises(
        UserError, match=r"1 paired docs have no sample under filter 'flexible-extract' \(e.g. doc_id 2\)"
    ):
        per_prompt_split(gsm(3), gsm(2), "exact_match,strict-match", "exact_match,flexible-extract")


def test_power_is_stated_at_the_level_of_the_interval():
    """7 regressions and 1 recovery of 100 at --confidence 0.9: the interval excludes 0 (p = 0.07), and the power
    beside it is at alpha 0.1 (MDE 7.0 points), not at 0.05 (7.8)."""
    from lm_eval_sink.buckets.render import power_lines
    from lm_eval_sink.power import connor_mde

    ref, cand = _rows(100, [1] * 7 + [0] + [1] * 92), _rows(100, [0] * 7 + [1] + [1] * 92)
    for confidence in (0.9, 0.95):
        rep = bucket(ref, cand, "boolq", BucketSettings(n_bootstrap=100, confidence=confidence))
        alpha = round(1 - confidence, 12)
        assert rep.power["alpha"] == alpha and rep.power["mde"] == pytest.approx(connor_mde(100, 0.08, alpha))
        assert (rep.delta_ci[1] < 0) == (rep.mcnemar_p < alpha) == (confidence == 0.9)
        assert f"Power (alpha {alpha:g} two-sided" in "\n".join(power_lines(rep.to_json()))
    assert round(100 * connor_mde(100, 0.08, 0.1), 1) < round(100 * connor_mde(100, 0.08, 0.05), 1) == 7.8
