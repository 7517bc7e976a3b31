"""Upstream's load routes, read from the schedulers' internal state (one control call, as
/get_server_info): `GET /get_load`, the list per data-parallel replica that sglang-router's load-aware
policies poll (`num_tokens` is the load they compare), and `GET /v1/loads`, upstream's newer report
(per replica, an aggregate; `?dp_rank=`, `?include=`, `?format=prometheus`).

A replica's load: `num_reqs` = running + waiting requests; `num_tokens` = the KV slots its requests hold
(the prefix cache's evictable entries not counted) plus the prompt tokens of its waiting requests
(`num_pending_tokens`), the work it has taken on.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from sglang.srt.managers.request_validation import RequestError
from sglang.version import __version__

SECTIONS = ("core", "memory", "queues", "disagg")


def replica_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Each replica's internal state (with --dp-size the controller keeps them; else the one)."""
    return state.get("data_parallel_states") or [state]


def legacy_loads(state: dict[str, Any]) -> list[dict[str, Any]]:
    now = time.time()
    out = []
    for d, s in enumerate(replica_states(state)):
        pending = s.get("num_waiting_tokens", 0)
        out.append({
            "dp_rank": d,
            "num_reqs": s["num_running_reqs"] + s["num_waiting_reqs"],
            "num_waiting_reqs": s["num_waiting_reqs"],
            "num_tokens": s["num_used_tokens"] + pending,
            "num_pending_tokens": pending,
            "ts_tic": now,
        })  # fmt: skip
    return out


def _load(d: int, s: dict[str, Any], sections: set[str]) -> dict[str, Any]:
    total = max(s["max_total_num_tokens"], 1)
    load: dict[str, Any] = {
        "dp_rank": d,
        "num_running_reqs": s["num_running_reqs"],
        "num_waiting_reqs": s["num_waiting_reqs"],
        "num_total_reqs": s["num_running_reqs"] + s["num_waiting_reqs"],
        "num_used_tokens": s["num_used_tokens"],
        "num_total_tokens": s["max_total_num_tokens"],
        "token_usage": round(s["num_used_tokens"] / total, 4),
        "gen_throughput": round(s.get("gen_throughput", 0.0), 2),
        "cache_hit_rate": round(s.get("cache_hit_rate", 0.0), 4),
        # (the share of the running cap in use: what admits the next request)
        "utilization": round(s["num_running_reqs"] / max(s["max_running_requests"], 1), 4),
    }
    if "memory" in sections:
        mamba = s["mamba_usage"]
        load["memory"] = {
            "token_usage": load["token_usage"],
            "num_used_mamba_slots": mamba["total"] - mamba["free"] - mamba["held_by_tree"],
            "num_total_mamba_slots": mamba["total"],
            "tree_cached_tokens": s["token_usage"]["held_by_tree"],
            "tree_cached_mamba_slots": mamba["held_by_tree"],
        }
    if "queues" in sections:
        load["queues"] = {
            "waiting": s["num_waiting_reqs"],
            "grammar": s.get("num_grammar_queue_reqs", 0),
            "pending_tokens": s.get("num_waiting_tokens", 0),
        }
    if "disagg" in sections and s.get("disaggregation_mode", "null") != "null":
        load["disaggregation"] = {"mode": s["disaggregation_mode"], **(s.get("disaggregation") or {})}
    return load


def v1_loads(state: dict[str, Any], dp_rank: int | None, include: str | None) -> tuple[list[dict], dict]:
    """(the loads asked for, their aggregate); a bad query parameter is a RequestError naming it."""
    sections = set(SECTIONS)
    if include:
        asked = {p.strip() for p in include.split(",") if p.strip()}
        unknown = sorted(asked - {*SECTIONS, "all"})
        if unknown:
            raise RequestError(
                f"include: {unknown[0]!r} is not one of {', '.join(SECTIONS)}, all.", "include"
            )
        sections = set(SECTIONS) if "all" in asked else asked | {"core"}
    states = replica_states(state)
    if dp_rank is not None and not 0 <= dp_rank < len(states):
        raise RequestError(f"dp_rank must be from 0 to {len(states) - 1}, got {dp_rank}.", "dp_rank")
    loads = [_load(d, s, sections) for d, s in enumerate(states) if dp_rank in (None, d)]
    n = len(loads)
    aggregate = {
        "total_running_reqs": sum(x["num_running_reqs"] for x in loads),
        "total_waiting_reqs": sum(x["num_waiting_reqs"] for x in loads),
        "total_reqs": sum(x["num_total_reqs"] for x in loads),
        "total_used_tokens": sum(x["num_used_tokens"] for x in loads),
        "total_tokens": sum(x["num_total_tokens"] for x in loads),
        "avg_token_usage": round(sum(x["token_usage"] for x in loads) / n, 4),
        "avg_throughput": round(sum(x["gen_throughput"] for x in loads) / n, 2),
        "avg_utilization": round(sum(x["utilization"] for x in loads) / n, 4),
    }
    return loads, aggregate


def v1_loads_body(loads: list[dict], aggregate: dict) -> dict[str, Any]:
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": __version__,
        "dp_rank_count": len(loads),
        "loads": loads,
        "aggregate": aggregate,
    }


def v1_loads_prometheus(loads: list[dict]) -> str:
    """Every number of the loads as a gauge `sglang_<name>` (a section's as `sglang_<section>_<name>`)
    labelled with its dp_rank, in Prometheus' text format."""
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        for key, value in load.items():
            if key == "dp_rank":
                continue
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for sub, v in items:
                if isinstance(v, int | float) and not isinstance(v, bool):
                    name = f"sglang_{key}" if sub is None else f"sglang_{key}_{sub}"
                    samples.setdefault(name, []).append((load["dp_rank"], v))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{d}"}} {v}' for d, v in values]
    return "\n".join(lines) + "\n"
