"""Where a results folder's runs were measured, as report lines: the device, threads (or a backend's workers) and
library versions of each session that wrote the folder. Numbers carry the conditions they were measured under
(STYLE.md), so the sweep and evaluation reports both list these."""

from __future__ import annotations


def environment_lines(meta: dict) -> list[str]:
    """One line per distinct (environment, backend) of the sessions that wrote the folder. A session on a backend
    (Ray) ran its units in worker processes: their count and threads are what the timings saw, not the driver's."""
    sessions = meta.get("sessions", [])
    seen: list[tuple] = []
    for session in sessions:
        key = (session.get("environment"), session.get("backend"))
        if key not in seen:
            seen.append(key)
    lines = []
    for env, backend in seen:
        if not env:
            continue
        if backend and backend.get("workers"):
            where = (
                f"{backend.get('backend', 'a backend')}: {backend['workers']} worker(s) x "
                f"{backend.get('threads_per_worker')} thread(s) on {backend.get('nodes')} node(s), "
                f"{backend.get('cpus')} CPUs"
            )
        else:
            where = f"{env.get('threads')} threads ({env.get('cpu_count')} CPUs, {env.get('processor')})"
        lines.append(
            f"- device {env.get('device')}, {where}; Python {env.get('python')}, torch {env.get('torch')}, "
            f"transformers {env.get('transformers')}, numpy {env.get('numpy')}, sparsedecode {env.get('sparsedecode')}"
            + (f" (source {env['revision']})" if env.get("revision") else "")
        )
    starts = [session.get("started") for session in sessions if session.get("started")]
    if starts:
        lines.append(f"- {len(sessions)} session(s) wrote this folder, the first started {starts[0]}")
    return lines
