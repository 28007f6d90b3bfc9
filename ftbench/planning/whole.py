"""ReCycle's whole-pipeline plans on the real failure set, from their reference.

With strategy.normalise=stage on a large grid, a failure set whose stages lost at most k
workers each runs the plan of k whole failed pipelines (canonically pipelines 0 .. k - 1). On
the real workers, at each stage a real failed worker beyond them trades places with a
canonically failed one that is alive (in order), the alive ones left over idle, and every
other worker is itself: the reference plan (every canonical worker present, the canonically
failed ones idle) with some workers' records renamed and the real failed ones absent.

At scale a reference serves several failures in a row (one more failed worker each), so the
tables of each renamed plan (records, kept replicas, nodes) are the last plan's, patched at
the stages whose failed workers changed, instead of a pass over every failed worker and
three over every worker. A patched table is what building it afresh gives, entry for entry
and in the same order (tests/test_recycle_normalise.py): where a worker comes back (it would
come last in a patched dict) the tables are built afresh.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WholeTables:
    """One renamed plan's tables: `renamed` (grid worker -> the reference worker whose records
    and replica it takes), `owners` (grid worker -> the real pipeline whose micro-batches it
    runs as its own), `absent` (the real failed workers), and the reference's records, kept
    replicas and nodes with those changes (`of`, `holds`, `node_of`)."""
    renamed: dict[int, int]
    owners: dict[int, int]
    absent: frozenset
    of: dict
    holds: dict
    node_of: dict


class WholeRenamings:
    """The tables of `most` whole failed pipelines' reference (`of`, `holds`, `node_of`: its
    records, kept replicas and nodes) renamed onto real failure sets, each patched from the
    last set's where it only grew."""

    def __init__(self, of: dict, holds: dict, node_of: dict, pp: int, most: int):
        self.of, self.holds, self.node_of, self.pp, self.most = of, holds, node_of, pp, most
        self._failed: frozenset | None = None  # the last failure set, by stage, its per-stage rows and tables
        self._down: dict[int, list[int]] = {}
        self._rows: dict[int, tuple] = {}
        self._tables: WholeTables | None = None

    def tables(self, failed) -> WholeTables:
        """The tables on the failure set `failed` ((pipeline, stage) positions). They are the
        plan's (not changed once made, as every plan), and the next set's start from them."""
        failed = frozenset(failed)
        if self._failed is not None and failed >= self._failed:
            stages = set()
            for d, s in failed - self._failed:
                self._down.setdefault(s, []).append(d)
                stages.add(s)
            tables = self._patched(stages)
        else:
            tables = self._built(failed)
        self._failed, self._tables = failed, tables
        return tables

    def _row(self, s: int, down: list[int]) -> tuple:
        """Stage s with these real failed pipelines: (renamed {worker: reference worker},
        owners {worker: pipeline}, absent workers)."""
        pp, most = self.pp, self.most
        lost = set(down)
        free = [i for i in range(most) if i not in lost]  # canonically failed, alive
        beyond = sorted(d for d in down if d >= most)  # failed, canonically alive
        renamed, owners = {}, {}
        for i, d in zip(free, beyond):  # real worker i runs canonical pipeline d's work
            w = i * pp + s
            renamed[w], owners[w] = d * pp + s, d
        return renamed, owners, {d * pp + s for d in down}

    def _built(self, failed: frozenset) -> WholeTables:
        down: dict[int, list[int]] = {}
        for d, s in failed:
            down.setdefault(s, []).append(d)
        self._down = down
        self._rows = {s: self._row(s, ds) for s, ds in down.items()}
        renamed, owners, absent = {}, {}, set()
        for row_renamed, row_owners, row_absent in self._rows.values():
            renamed.update(row_renamed)
            owners.update(row_owners)
            absent |= row_absent
        of, holds, node_of = dict(self.of), dict(self.holds), dict(self.node_of)
        of.update((w, self.of[r]) for w, r in renamed.items())
        holds.update((w, self.holds[r]) for w, r in renamed.items())
        for w in absent:
            del of[w], holds[w], node_of[w]
        return WholeTables(renamed, owners, frozenset(absent), of, holds, node_of)

    def _patched(self, stages: set[int]) -> WholeTables:
        last = self._tables
        renamed, owners, absent = dict(last.renamed), dict(last.owners), set(last.absent)
        of, holds, node_of = last.of.copy(), last.holds.copy(), last.node_of.copy()
        for s in stages:
            old_renamed, old_owners, old_absent = self._rows.get(s, ({}, {}, set()))
            row = self._rows[s] = self._row(s, self._down[s])
            new_renamed, new_owners, new_absent = row
            for w in old_renamed:  # (new_absent holds old_absent: workers only fail here)
                del renamed[w], owners[w]
                if w not in new_renamed and w not in new_absent:
                    of[w], holds[w] = self.of[w], self.holds[w]  # itself again
            renamed.update(new_renamed)
            owners.update(new_owners)
            of.update((w, self.of[r]) for w, r in new_renamed.items())
            holds.update((w, self.holds[r]) for w, r in new_renamed.items())
            for w in new_absent - old_absent:
                del of[w], holds[w], node_of[w]
            absent |= new_absent
        return WholeTables(renamed, owners, frozenset(absent), of, holds, node_of)
