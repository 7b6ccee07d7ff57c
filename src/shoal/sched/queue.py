"""Who goes next when not everything fits: strict priority classes, weighted fair share inside a class.

`FairQueue` holds pending requests (any payload with its `Request`). The next one comes from the most
important class with work waiting; inside it, from the project holding the least per unit of weight,
then from that project's job holding the least per unit of its weight, oldest first. A job at its
`max_sandboxes` waits until one of its sandboxes closes. What a job or project "holds" is its live
sandboxes, kept by `charge` (placed: +1, closed: -1) — so a burst of one job cannot starve another
job of the same class that asked later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shoal.errors import QuotaExceeded
from shoal.sched.policy import Policy
from shoal.sched.state import Request


@dataclass
class Job:
    """A job's share settings and what it holds now."""

    name: str
    project: str = "default"
    weight: float = 1.0
    #: live sandboxes the job may hold (None: no cap)
    max_sandboxes: int | None = None
    held: int = 0


class JobBook:
    """Jobs and projects with what each holds (the fair-share ledger, shared by queue and drivers)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.jobs: dict[str, Job] = {}
        self.project_held: dict[str, int] = {}

    def job(self, name: str, project: str = "default") -> Job:
        """The job named `name` (created with the policy's default weight on first use)."""
        j = self.jobs.get(name)
        if j is None:
            j = self.jobs[name] = Job(name, project, self.policy.default_weight)
        return j

    def configure(self, name: str, project: str = "default", *, weight: float | None = None,
                  max_sandboxes: int | None = None) -> Job:
        """Set a job's weight and cap (values given win; None leaves them)."""
        j = self.job(name, project)
        if weight is not None:
            j.weight = float(weight)
        if max_sandboxes is not None:
            j.max_sandboxes = int(max_sandboxes)
        return j

    def charge(self, job: str, project: str, count: int) -> None:
        """`count` sandboxes of the job were placed (positive) or closed (negative)."""
        j = self.job(job, project)
        j.held += count
        self.project_held[project] = self.project_held.get(project, 0) + count

    def room(self, job: str, project: str = "default") -> int | None:
        """How many more sandboxes the job may hold (None: no cap)."""
        j = self.job(job, project)
        return None if j.max_sandboxes is None else max(0, j.max_sandboxes - j.held)

    def check(self, job: str, project: str, n: int = 1) -> None:
        """Raise QuotaExceeded when `n` more sandboxes would pass the job's cap (for drivers without a queue)."""
        left = self.room(job, project)
        if left is not None and n > left:
            j = self.jobs[job]
            raise QuotaExceeded(
                f"job {job!r} may hold {j.max_sandboxes} sandboxes and holds {j.held}; {n} more would pass "
                "its max_sandboxes: close some of its sandboxes or raise the cap",
                job=job, max_sandboxes=j.max_sandboxes, held=j.held)

    def share(self, job: str, project: str) -> tuple[float, float]:
        """(project held / project weight, job held / job weight): smaller goes first."""
        j = self.job(job, project)
        pw = self.policy.project_weight(project)
        return (self.project_held.get(project, 0) / pw, j.held / j.weight)


class FairQueue:
    """Pending requests in fair-share order (see the module docstring)."""

    def __init__(self, policy: Policy, book: JobBook | None = None) -> None:
        self.policy = policy
        self.book = book or JobBook(policy)
        # rank -> project -> job -> FIFO of (payload, request)
        self._q: list[dict[str, dict[str, deque[tuple[Any, Request]]]]] = [{} for _ in policy.priorities]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, item: Any, req: Request) -> None:
        """Queue `item` (anything; the driver's handle) waiting for `req` to be placed."""
        self._q[req.priority].setdefault(req.project, {}).setdefault(req.job, deque()).append((item, req))
        self._len += 1

    def push_front(self, item: Any, req: Request) -> None:
        """Put back an item taken by `pop` that could not be placed (it keeps its turn)."""
        self._q[req.priority].setdefault(req.project, {}).setdefault(req.job, deque()).appendleft((item, req))
        self._len += 1

    def peek(self) -> tuple[Any, Request] | None:
        """The next (item, request) to place, or None when nothing may go (empty, or every job at its cap)."""
        d = self._pick()
        return d[0] if d is not None else None

    def pop(self) -> tuple[Any, Request] | None:
        """Take the next (item, request) out of the queue (None as `peek`)."""
        d = self._pick()
        if d is None:
            return None
        out = d.popleft()
        self._len -= 1
        req = out[1]
        if not d:
            jobs = self._q[req.priority][req.project]
            del jobs[req.job]
            if not jobs:
                del self._q[req.priority][req.project]
        return out

    def waiting(self, rank: int | None = None) -> int:
        """Requests waiting (of one class)."""
        if rank is None:
            return self._len
        return sum(len(d) for jobs in self._q[rank].values() for d in jobs.values())

    def items(self) -> Iterator[tuple[Any, Request]]:
        """Every waiting (item, request), most important class first (no fair-share order inside)."""
        for by_project in self._q:
            for jobs in by_project.values():
                for d in jobs.values():
                    yield from d

    def _pick(self) -> deque[tuple[Any, Request]] | None:
        book = self.book
        for by_project in self._q:
            if not by_project:
                continue
            best: deque[tuple[Any, Request]] | None = None
            best_key: tuple[float, float] | None = None
            for project, jobs in by_project.items():
                for job, d in jobs.items():
                    j = book.jobs.get(job)
                    if j is not None and j.max_sandboxes is not None and j.held >= j.max_sandboxes:
                        continue
                    key = book.share(job, project)
                    if best_key is None or key < best_key:
                        best, best_key = d, key
            if best is not None:
                return best
        return None
