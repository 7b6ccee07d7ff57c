"""Jobs: sandboxes grouped by what they are for (a rollout step, an eval run, an interactive user).

    step = client.job("run3/step17", priority="train-rollout", max_sandboxes=4096)
    boxes = await step.create_many("task-img", n=512, all_or_nothing=True)
    ...
    await step.close_all()

A job is nothing but labels every one of its sandboxes carries (`shoal.job`, `shoal.priority`,
`shoal.max-sandboxes`, `shoal.weight`; see docs/scheduling.md), so it works on every transport: the
embedded node and `shoal serve` read them for preemption and job caps today, the cluster scheduler for
placement and fair share. Creating with those labels by hand is the same thing.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from shoal.errors import InvalidRequest, SandboxNotFound, ShoalError
from shoal.models import SandboxInfo
from shoal.sched.policy import LABEL_JOB, LABEL_MAX_SANDBOXES, LABEL_PRIORITY, LABEL_WEIGHT, labels_for_job

if TYPE_CHECKING:
    from shoal.sdk.client import Client
    from shoal.sdk.sandbox import Sandbox

_JOB_LABELS = (LABEL_JOB, LABEL_PRIORITY, LABEL_MAX_SANDBOXES, LABEL_WEIGHT)


def check_job_args(name: str, priority: str | None, max_sandboxes: int | None, weight: float | None) -> None:
    """Reject a bad job name, cap or weight early (the priority class is checked where the policy lives)."""
    if not isinstance(name, str) or not 0 < len(name) <= 128 or "\0" in name:
        raise InvalidRequest(f"job name {name!r} must be 1-128 characters")
    if priority is not None and (not isinstance(priority, str) or not priority):
        raise InvalidRequest(f"priority {priority!r} must be a priority class name, e.g. 'train-rollout'")
    if max_sandboxes is not None and (isinstance(max_sandboxes, bool) or not isinstance(max_sandboxes, int)
                                      or max_sandboxes < 1):
        raise InvalidRequest(f"max_sandboxes={max_sandboxes!r} must be a positive integer")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int | float)
                               or not 0 < weight < 1e6):
        raise InvalidRequest(f"weight={weight!r} must be a positive number")


class Job:
    """Create and list the sandboxes of one job (see the module docstring). Get one from `Client.job`."""

    def __init__(self, client: Client, name: str, *, priority: str | None = None, max_sandboxes: int | None = None,
                 weight: float | None = None) -> None:
        check_job_args(name, priority, max_sandboxes, weight)
        self.client = client
        self.name = name
        self.priority = priority
        self.max_sandboxes = max_sandboxes
        self.weight = weight
        #: the labels each sandbox of the job carries
        self.labels = labels_for_job(name, priority, max_sandboxes, weight)

    def __repr__(self) -> str:
        return f"<Job {self.name!r} priority={self.priority!r} max_sandboxes={self.max_sandboxes}>"

    def _with_labels(self, kw: dict[str, Any]) -> dict[str, Any]:
        labels = dict(kw.get("labels") or {})
        for k in _JOB_LABELS:
            if k in labels and labels[k] != self.labels.get(k, labels[k]):
                raise InvalidRequest(f"label {k}={labels[k]!r} contradicts job {self.name!r} ({self.labels.get(k)!r})")
        labels.update(self.labels)
        return {**kw, "labels": labels}

    async def create(self, image: str = "base", **kw: Any) -> Sandbox:
        """Create one sandbox of the job (the options of `Client.create`)."""
        return await self.client.create(image, **self._with_labels(kw))

    async def create_many(self, image: str = "base", n: int = 1, *, all_or_nothing: bool = False,
                          return_errors: bool = True, **kw: Any) -> list[Sandbox | ShoalError]:
        """Create a burst of the job's sandboxes (see `Client.create_many`, including `all_or_nothing`)."""
        return await self.client.create_many(image, n, all_or_nothing=all_or_nothing, return_errors=return_errors,
                                             **self._with_labels(kw))

    async def list(self) -> list[SandboxInfo]:
        """The job's sandboxes visible to this client."""
        return await self.client.list(labels={LABEL_JOB: self.name})

    async def close_all(self) -> int:
        """Close every sandbox of the job visible to this client; returns how many were closed."""
        infos = await self.list()
        t = await self.client._ensure()

        async def one(sid: str) -> int:
            with contextlib.suppress(SandboxNotFound):
                await t.close(sid)
                self.client._owned.discard(sid)
                return 1
            return 0

        return sum(await asyncio.gather(*(one(i.id) for i in infos)))
