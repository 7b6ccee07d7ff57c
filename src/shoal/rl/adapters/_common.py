"""Plumbing shared by the adapters: one shoal client per event loop, task lookup by id, and turning an LLM's
action text into a shoal action. (Synchronous trainer APIs use `shoal.sdk.sync.shared_client()`.)"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path
from typing import Any

from shoal.config import settings
from shoal.errors import InvalidRequest
from shoal.rl.env import Action, normalize_action
from shoal.rl.tasks import HarborTask, SWETask, Task, load_tasks, task_from_dict

#: where adapters find tasks by id when the trainer passes only an id (or set `tasks=` explicitly)
TASKS_ENV = "SHOAL_RL_TASKS"

_clients: dict[int, Any] = {}
_task_cache: dict[str, dict[str, Task]] = {}
_lock = threading.Lock()


def loop_client() -> Any:
    """An embedded shoal.Client for the running event loop (made once per loop; trainers own the loop)."""
    from shoal.sdk.client import Client

    loop = asyncio.get_running_loop()
    c = _clients.get(id(loop))
    if c is None:
        c = Client()
        _clients[id(loop)] = c
    return c


def resolve_task(task: Any = None, task_id: str | None = None, tasks: str | Path | list[Task] | None = None) -> Task:
    """A Task from a Task, a task dict, or an id looked up in `tasks` (a file/dir, a list, or $SHOAL_RL_TASKS)."""
    if isinstance(task, (SWETask, HarborTask)):
        return task
    if isinstance(task, dict):
        return task_from_dict(task)
    if isinstance(task, str) and task_id is None:
        task_id = task
    if not task_id:
        raise InvalidRequest("no task given: pass task= (a task or its dict) or task_id= with tasks= or "
                             f"${TASKS_ENV} naming a tasks file")
    if isinstance(tasks, list):
        for t in tasks:
            if t.id == task_id:
                return t
        raise InvalidRequest(f"task {task_id!r} is not among the {len(tasks)} tasks given")
    src = str(tasks or settings().rl_tasks or "")
    if not src:
        raise InvalidRequest(f"task {task_id!r} given by id, but no tasks file: pass tasks= or set ${TASKS_ENV}")
    with _lock:
        table = _task_cache.get(src)
        if table is None:
            table = {t.id: t for t in load_tasks(src)}
            _task_cache[src] = table
    if task_id not in table:
        raise InvalidRequest(f"task {task_id!r} is not in {src}")
    return table[task_id]


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_FENCE = re.compile(r"```(?:bash|sh|shell|console)\s*\n(.*?)```", re.S)
_BASH_TAG = re.compile(r"<bash>(.*?)</bash>", re.S)
_SUBMIT = re.compile(r"<submit\s*/?>|^\s*submit\s*$", re.M | re.I)


def parse_action_text(text: str) -> Action | None:
    """The action in a model's text: a `<tool_call>{json}</tool_call>`, a ```bash block, a <bash> tag, or
    `<submit/>`. None when the text holds no action (the episode should tell the model so)."""
    m = _TOOL_CALL.search(text)
    if m:
        try:
            return normalize_action(json.loads(m.group(1)))
        except (json.JSONDecodeError, InvalidRequest):
            return None
    if _SUBMIT.search(text) and not (_FENCE.search(text) or _BASH_TAG.search(text)):
        return {"tool": "submit"}
    m = _BASH_TAG.search(text) or _FENCE.search(text)
    if m and m.group(1).strip():
        return {"tool": "bash", "command": m.group(1).strip()}
    return None


NO_ACTION = ("No action found. Reply with one shell command in a ```bash block (or <bash>…</bash>, or a "
             "<tool_call> JSON), or <submit/> when you are done.")
