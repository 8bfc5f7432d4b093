"""The Ray engine's decisions, with no Ray: which units to submit next, and what a finished unit changes.

`engines.run_on_ray` submits what `Scheduler.submit_next` returns and reports each finished task to
`Scheduler.finish`; the rules live here so that they are tested without a cluster:
- units are taken in plan order; an eval/strength unit of a checkpoint whose merge is among the
  units starts after that merge has finished;
- at most `bound` checkpoints are merging, or merged with downstream units left (the merged
  checkpoints waiting on disk for their evaluation);
- a failed merge marks the downstream units of its checkpoint "not run: merge:X failed".
A unit is anything with `id`, `kind` ("merge", "eval" or "strength") and `checkpoint`.
"""

from __future__ import annotations

from typing import Any


class Scheduler:
    """The scheduling state of one run: waiting units, checkpoints merged or pending, units in flight."""

    def __init__(self, units: list[Any], bound: int) -> None:
        if bound < 1:
            raise ValueError(f"bound must be >= 1, got {bound}")
        self.bound = bound
        self.waiting = list(units)  # not yet submitted, plan order
        self.in_flight: set[str] = set()
        self.merges = {u.checkpoint: u.id for u in units if u.kind == "merge"}
        self.downstream: dict[str, set[str]] = {
            c: {u.id for u in units if u.kind != "merge" and u.checkpoint == c} for c in self.merges
        }
        self.merged: set[str] = set()  # checkpoints whose merge finished
        self.pending: set[str] = set()  # checkpoints merging, or merged with downstream units left

    @property
    def done(self) -> bool:
        return not self.waiting and not self.in_flight

    def _ready(self, u: Any) -> bool:
        if u.kind == "merge":
            return len(self.pending) < self.bound
        return u.checkpoint not in self.merges or u.checkpoint in self.merged

    def submit_next(self) -> list[Any]:
        """The waiting units that may start now, in plan order (they count as in flight from here on).

        Raises RuntimeError when units wait but none may ever start (a bug, not an input error)."""
        out = []
        for u in list(self.waiting):
            if not self._ready(u):  # an earlier merge of this pass may have filled the bound
                continue
            self.waiting.remove(u)
            self.in_flight.add(u.id)
            if u.kind == "merge":
                self.pending.add(u.checkpoint)
            out.append(u)
        if self.waiting and not self.in_flight:
            raise RuntimeError(f"ray engine: {len(self.waiting)} unit(s) can never start")
        return out

    def finish(self, u: Any, error: str | None) -> list[tuple[Any, str]]:
        """Record that `u` finished (error None) or failed; returns the units that will now never run,
        each with its line ("not run: merge:X failed"), removed from the waiting list."""
        self.in_flight.discard(u.id)
        c = u.checkpoint
        if u.kind == "merge":
            if error is not None:
                self.pending.discard(c)
                lost = [w for w in self.waiting if w.id in self.downstream[c]]
                for w in lost:
                    self.waiting.remove(w)
                return [(w, f"not run: {u.id} failed") for w in lost]
            self.merged.add(c)
        elif c in self.merges:
            self.downstream[c].discard(u.id)
        if c in self.merges and c in self.merged and not self.downstream[c]:
            self.pending.discard(c)
        return []
