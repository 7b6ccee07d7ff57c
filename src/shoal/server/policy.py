"""The operator's policy over what a project's sandboxes may ask for (issue 23, items 6 and 7).

Applied by the API server to every create (native API, batches, gangs, E2B), before the spec reaches a
node:

- **egress grants** — the protected destinations (private ranges, link-local/metadata, reserved ranges,
  the cluster's own nodes; shoal.egress) the project's sandboxes may reach, from `shoal token policy
  PROJECT --egress-allow ...`, go into the spec's `egress_grants`; the node adds its `egress_allow` setting,
  opens them for `network=True` and refuses (EgressForbidden, 403 naming the rule) an allowlist rule
  outside them. A project token cannot grant itself anything: a request carrying `egress_grants` is
  refused unless it comes from an admin token (an operator);
- **priority classes** — a sandbox's `shoal.priority` label must name a class granted to its project
  (`--priorities`); without a grant a project may use the default class (`default_priority`) and the
  classes below it, so no project preempts others by labelling itself `train-rollout`. Admin tokens may
  use every class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shoal.errors import Forbidden
from shoal.server.tokens import Principal

if TYPE_CHECKING:
    from shoal.server.deps import ServerState


def granted_priorities(st: Any, project: str) -> list[str]:
    """The priority classes a project may use (`st`: anything with the server's `tokens`, the CLI passes its store)."""
    from shoal.config import settings

    s = settings()
    pol = st.tokens.policy(project)
    if pol.priorities is not None:
        return list(pol.priorities)
    names = list(s.priorities)
    start = names.index(s.default_priority) if s.default_priority in names else len(names) - 1
    return names[start:]


def check_priority(st: ServerState, who: Principal, project: str, labels: dict[str, str] | None) -> None:
    """Forbidden when the labels name a priority class not granted to the project (admins: any class)."""
    from shoal.config import settings
    from shoal.sched.policy import LABEL_PRIORITY

    cls = (labels or {}).get(LABEL_PRIORITY)
    if cls is None or who.admin or cls not in settings().priorities:
        return  # no class (the default), an operator, or a name the node refuses as unknown
    granted = granted_priorities(st, project)
    if cls not in granted:
        raise Forbidden(f"priority class {cls!r} ({LABEL_PRIORITY}) is not granted to project {project!r}: it may "
                        f"use {', '.join(granted)}; the operator grants more with `shoal token policy {project} "
                        "--priorities ...`", label=LABEL_PRIORITY, value=cls, granted=granted)


def apply_policy(st: ServerState, who: Principal, data: dict[str, Any]) -> dict[str, Any]:
    """Spec fields from a client (`project` already decided) with the operator's policy applied: the
    project's egress grants filled in, the priority class checked. Returns `data`, changed in place."""
    project = str(data.get("project") or who.project)
    asked = data.get("egress_grants")
    if asked is not None and not who.admin:
        raise Forbidden("egress_grants are the operator's to give (`shoal token policy PROJECT --egress-allow "
                        "...`): leave the field out", field="egress_grants")
    if asked is None:
        grants = st.tokens.policy(project).egress_allow
        data["egress_grants"] = list(grants) or None
    check_priority(st, who, project, data.get("labels"))
    return data
