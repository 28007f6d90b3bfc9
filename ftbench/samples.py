"""Which samples an iteration trains, and the training-semantics ledger of a run.

The samples of iteration i are fixed by (seed, i): sample j of the iteration's numbering is the
same tokens whoever computes it (ftbench.models.data). Pipeline p of a plan trains its
micro-batches from `sample_offsets[p]` on (in micro-batches; consecutive by default), so a
plan names exactly the samples it trains: the whole global batch for every strategy that keeps
it, fewer where a step goes on without some data-parallel replicas (torchft's replica groups,
which keep their own samples while others are out).

`SamplesLedger` records, for every iteration the final model holds, the sample ranges its kept
execution trained; the equivalence check replays fault-free training under it
(ftbench.fault_free), so a run that dropped samples is checked as strictly as one that did not.
"""
from __future__ import annotations


def pipeline_offsets(plan) -> tuple[int, ...]:
    """The first micro-batch (of the iteration's numbering) of each pipeline of `plan`."""
    offsets = getattr(plan, "sample_offsets", None)
    if offsets is not None:
        return offsets
    counts, total, out = plan.schedule.microbatches, 0, []
    for count in counts:
        out.append(total)
        total += count
    return tuple(out)


def sample_ranges(plan, microbatch_size: int, without: frozenset = frozenset()) -> tuple[tuple[int, int], ...]:
    """The samples one iteration of `plan` trains, as sorted, merged [first, end) ranges of the
    iteration's numbering (memoised on the plan: 2,048 pipelines at scale); `without`, pipelines
    whose samples do not count (a failure's groups under torchft's LocalSGD or DiLoCo)."""
    memo = plan.__dict__.get("_ranges_memo")
    if not without and memo is not None and memo[0] == microbatch_size:
        return memo[1]
    pieces = sorted((o * microbatch_size, (o + c) * microbatch_size)
                    for d, (o, c) in enumerate(zip(pipeline_offsets(plan), plan.schedule.microbatches))
                    if c > 0 and d not in without)
    merged: list[list[int]] = []
    for first, end in pieces:
        if merged and first <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([first, end])
    ranges = tuple((a, b) for a, b in merged)
    if not without:
        plan.__dict__["_ranges_memo"] = (microbatch_size, ranges)
    return ranges


def count(ranges) -> int:
    """How many samples `ranges` hold."""
    return sum(end - first for first, end in ranges)


def plan_samples(plan, microbatch_size: int) -> int:
    """The samples one iteration of `plan` trains."""
    return count(sample_ranges(plan, microbatch_size))


def counted(ranges, first: int, end: int) -> bool:
    """Whether samples [first, end) all lie in `ranges`."""
    return any(a <= first and end <= b for a, b in ranges)


class IterationRuns:
    """Runs of consecutive iterations the final model holds, as [first, count, value each]:
    sim adds a segment of identical iterations at once, local and dist one at a time. A
    rollback to iteration k drops every iteration from k on (they are redone, and count when
    they are)."""

    def __init__(self):
        self.runs: list[list] = []

    def add(self, first: int, count: int, value) -> None:
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] + last[1] == first and last[2] == value:
            last[1] += count
        else:
            self.runs.append([first, count, value])

    def rollback(self, to: int) -> None:
        """Iterations `to` and later are lost: the run continues from iteration `to`."""
        while self.runs and self.runs[-1][0] >= to:
            self.runs.pop()
        if self.runs and self.runs[-1][0] + self.runs[-1][1] > to:
            self.runs[-1][1] = to - self.runs[-1][0]


class SamplesLedger(IterationRuns):
    """The training-semantics ledger: the samples that counted in each iteration the final
    model holds (each iteration once, as its kept execution trained it): the value of each run
    is its plan's `sample_ranges`."""

    def samples(self) -> int:
        return sum(n * count(ranges) for _, n, ranges in self.runs)

    def entries(self) -> list[list]:
        """[first, last, samples each, [[first sample, end], ...]] per run of iterations."""
        return [[first, first + n - 1, count(ranges), [list(r) for r in ranges]] for first, n, ranges in self.runs]


def replayed(entries, global_batch: int) -> dict[int, tuple[tuple[int, int], ...]] | None:
    """{iteration: sample ranges} of a ledger's entries where an iteration trained other than
    the whole global batch; None where every iteration trained it (nothing to replay)."""
    whole = ((0, global_batch),)
    out = {}
    for first, last, _, ranges in entries or ():
        ranges = tuple(tuple(r) for r in ranges)
        if ranges != whole:
            out.update(dict.fromkeys(range(first, last + 1), ranges))
    return out or None



def sync_points(entries, steps) -> list[list]:
    """LocalSGD's or DiLoCo's syncs as the ledger's entries show them (ftbench.local_sgd), as
    [first sync's iteration, last sync's, [participating groups], [healing groups], samples
    that counted in their windows] per run of consecutive windows alike: a group takes part
    in a window's sync when it trained every iteration of the window; one that trained its
    last iteration but not all of them heals there. Groups are the configured grid's
    pipelines, in order (steps.group_samples). A window the run ended in before its sync
    counts nothing."""
    out: list[list] = []
    each: list[int] = []  # per run of windows: one window's samples (windows alike merge)
    window = None  # [index, last iteration, participants, present last, iterations]

    def close(w) -> None:
        if w is None or not steps.syncs_after(w[1]):
            return
        samples = w[4] * sum(b - a for g, (a, b) in enumerate(steps.group_samples) if g in w[2])
        groups = [sorted(w[2]), sorted(w[3] - w[2])]
        if out and out[-1][2:4] == groups and each[-1] == samples and steps.window(out[-1][1]) + 1 == w[0]:
            out[-1][1] = w[1]
            out[-1][4] += samples
        else:
            out.append([w[1], w[1], *groups, samples])
            each.append(samples)

    for first, last, _, ranges in entries or ():
        ranges = [tuple(r) for r in ranges]
        present = frozenset(g for g, (a, b) in enumerate(steps.group_samples) if counted(ranges, a, b))
        i = first
        while i <= last:
            index = steps.window(i)
            end = min(last, (index + 1) * steps.sync_every - 1)
            if window is None or window[0] != index:
                close(window)
                window = [index, end, present, present, end - i + 1]
            else:
                window[1], window[2], window[3] = end, window[2] & present, present
                window[4] += end - i + 1
            i = end + 1
    close(window)
    return out
