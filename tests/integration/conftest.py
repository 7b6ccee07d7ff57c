"""Fixtures shared by the RL integration tests (test_rl.py and the trainer/harness integrations)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import shoal
from shoal.rl.taskgen.config import load_task_recipe
from shoal.rl.taskgen.generate import generate_tasks
from shoal.rl.tasks import SWETask


@pytest.fixture(scope="session")
def rl_tasks(shoal_home: Path, base_image: str) -> list[SWETask]:
    """Two generated tasks of the `inflection` project (images cached in the shared store)."""
    tr = load_task_recipe().select(["inflection"])
    tr.mutations.tasks_per_project = 2
    tr.mutations.max_candidates = 8

    async def go() -> list[SWETask]:
        async with shoal.Client() as c:
            return await generate_tasks(c.transport.node, tr)

    tasks = asyncio.run(go())
    assert len(tasks) == 2
    return tasks
