"""The Ray engine's scheduling decisions (`merging.scheduler.Scheduler`), without a cluster."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from lm_eval_sink.merging.scheduler import Scheduler


@dataclass(frozen=True)
class U:
    kind: str
    checkpoint: str

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.checkpoint}"


def _plan(checkpoints: list[str], endpoints: tuple[str, ...] = ("reference", "candidate")) -> list[U]:
    """Plan order as `merging.sweep.plan_units` makes it: endpoints first, then merge, eval, strength each."""
    units = [U(k, e) for e in endpoints for k in ("eval", "strength")]
    return units + [U(k, c) for c in checkpoints for k in ("merge", "eval", "strength")]


def _ids(units) -> list[str]:
    return [u.id for u in units]


def test_merges_wait_for_the_bound_and_evals_for_their_merge():
    s = Scheduler(_plan(["a", "b"]), bound=1)
    first = s.submit_next()
    assert _ids(first) == ["eval:reference", "strength:reference", "eval:candidate", "strength:candidate", "merge:a"]
    assert s.submit_next() == []  # merge:b waits: checkpoint a is pending; a's units wait for its merge
    assert s.finish(U("merge", "a"), None) == []
    assert _ids(s.submit_next()) == ["eval:a", "strength:a"]  # merge:b still waits: a has units left
    s.finish(U("eval", "a"), None)
    assert s.submit_next() == []
    s.finish(U("strength", "a"), None)
    assert _ids(s.submit_next()) == ["merge:b"]
    assert not s.done


def test_bound_two_runs_two_merges_at_once_in_plan_order():
    s = Scheduler(_plan(["a", "b", "c"], endpoints=()), bound=2)
    assert _ids(s.submit_next()) == ["merge:a", "merge:b"]
    s.finish(U("merge", "b"), None)  # b finished first: its units may start, c still waits (a and b pending)
    assert _ids(s.submit_next()) == ["eval:b", "strength:b"]


def test_units_without_their_merge_in_the_run_start_at_once():
    """A resumed sweep: merge:a finished earlier (not among the units), so its eval starts with the rest."""
    s = Scheduler([U("eval", "a"), U("merge", "b"), U("eval", "b")], bound=1)
    assert _ids(s.submit_next()) == ["eval:a", "merge:b"]


@pytest.mark.parametrize("seed", range(20))
def test_any_finishing_order_runs_each_unit_once_in_dependency_order_within_the_bound(seed):
    rng = random.Random(seed)
    units = _plan(["a", "b", "c", "d"])
    bound = rng.choice([1, 2, 3])
    failing = {f"merge:{rng.choice('abcd')}", f"eval:{rng.choice('abcd')}"}  # a failed eval blocks no merge
    s = Scheduler(units, bound=bound)
    started, outcome, flying = [], {}, []
    while not s.done:
        new = s.submit_next()
        assert all(
            u.kind == "merge" or u.checkpoint not in "abcd" or outcome.get(f"merge:{u.checkpoint}") == "ok" for u in new
        )
        started += _ids(new)
        flying += new
        assert len(s.pending) <= bound  # merging, or merged with units left
        u = flying.pop(rng.randrange(len(flying)))
        error = "failed" if u.id in failing else None
        outcome[u.id] = "ok" if error is None else error
        for lost, line in s.finish(u, error):
            outcome[lost.id] = line
    assert sorted(started) == sorted(set(started))  # none submitted twice
    assert sorted(outcome) == sorted(_ids(units))
    bad = next(f for f in failing if f.startswith("merge:"))
    ck = bad.split(":")[1]
    assert outcome[f"eval:{ck}"] == outcome[f"strength:{ck}"] == f"not run: {bad} failed"
    assert all(v == ("failed" if k in failing else "ok") for k, v in outcome.items() if not k.endswith(f":{ck}"))


def test_bound_below_one_is_a_bug():
    with pytest.raises(ValueError, match="bound"):
        Scheduler([], bound=0)
