"""The summary of a benchmark run: upstream bench_serving's rows (same names), then the server's cache
hit rate and mamba slot statistics. Latencies are in ms; TPOT is (latency - TTFT) / (output tokens - 1)
per request with more than one output token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang.benchmark.backends import RequestOutput


@dataclass
class ServerStats:
    """Sampled from /get_server_info while the run goes on, and the cache counters around it."""

    running: list[int] = field(default_factory=list)
    slots_per_running_req: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # counted by the server over the run
    cached_tokens: int = 0

    def sample(self, state: dict[str, Any]) -> None:
        running = state.get("num_running_reqs", 0)
        self.running.append(running)
        held = (state.get("mamba_usage") or {}).get("held_by_requests")
        if running and held is not None:
            self.slots_per_running_req.append(held / running)


def _stats(prefix: str, values: list[float], scale: float = 1000.0, extra: tuple[str, ...] = ()) -> dict:
    arr = np.asarray(values, dtype=float) * scale if values else np.zeros(1)
    out = {
        f"mean_{prefix}_ms": float(arr.mean()),
        f"median_{prefix}_ms": float(np.median(arr)),
        f"std_{prefix}_ms": float(arr.std()),
        f"p99_{prefix}_ms": float(np.percentile(arr, 99)),
    }
    for name in extra:
        out[f"{name}_{prefix}_ms"] = float(arr.max() if name == "max" else np.percentile(arr, int(name[1:])))
    return out


def compute_metrics(
    outputs: list[RequestOutput], duration: float, tokenizer: Any, stats: ServerStats
) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_len for o in ok)
    retokenized = sum(len(tokenizer.encode(o.generated_text, add_special_tokens=False)) for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_output_tokens_retokenized": retokenized,
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "concurrency": sum(o.latency for o in ok) / duration,
        "cached_tokens": sum(o.cached_tokens for o in ok),
    }
    m.update(_stats("e2e_latency", [o.latency for o in ok]))
    m.update(_stats("ttft", [o.ttft for o in ok]))
    m.update(_stats("tpot", tpots))
    m.update(_stats("itl", [gap for o in ok for gap in o.itl], extra=("p95", "max")))
    m["cache_hit_rate"] = m["cached_tokens"] / input_tokens if input_tokens else 0.0
    if stats.prompt_tokens:
        m["server_cache_hit_rate"] = stats.cached_tokens / stats.prompt_tokens
    m["peak_running_requests"] = max(stats.running, default=0)
    slots = stats.slots_per_running_req
    m["mean_slots_per_running_req"] = float(np.mean(slots)) if slots else None
    m["peak_slots_per_running_req"] = max(slots, default=None)
    return m


def _row(name: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{name:<40} {value!s:<10}"


def format_summary(args: Any, m: dict[str, Any], server: dict[str, Any]) -> str:
    rate = "inf" if args.request_rate == float("inf") else args.request_rate
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _row("Backend:", args.backend),
        _row("Traffic request rate:", rate),
        _row("Max request concurrency:", args.max_concurrency or "not set"),
        _row("Successful requests:", m["completed"]),
        _row("Benchmark duration (s):", m["duration"]),
        _row("Total input tokens:", m["total_input_tokens"]),
        _row("Total generated tokens:", m["total_output_tokens"]),
        _row("Total generated tokens (retokenized):", m["total_output_tokens_retokenized"]),
        _row("Request throughput (req/s):", m["request_throughput"]),
        _row("Input token throughput (tok/s):", m["input_throughput"]),
        _row("Output token throughput (tok/s):", m["output_throughput"]),
        _row("Total token throughput (tok/s):", m["total_throughput"]),
        _row("Concurrency:", m["concurrency"]),
    ]
    sections = [
        ("End-to-End Latency", "E2E Latency", "e2e_latency", ("mean", "median", "p99")),
        ("Time to First Token", "TTFT", "ttft", ("mean", "median", "p99")),
        ("Time per Output Token (excl. 1st token)", "TPOT", "tpot", ("mean", "median", "p99")),
        ("Inter-Token Latency", "ITL", "itl", ("mean", "median", "p95", "p99", "max")),
    ]
    for title, short, key, stats in sections:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat in stats:
            label = stat.capitalize() if stat in ("mean", "median", "max") else stat.upper()
            lines.append(_row(f"{label} {short} (ms):", m[f"{stat}_{key}_ms"]))
    lines.append("{s:{c}^{n}}".format(s="Prefix Cache and Mamba Slots", n=50, c="-"))
    lines.append(_row("Mamba scheduler strategy:", server.get("mamba_scheduler_strategy", "?")))
    lines.append(_row("Cached input tokens:", m["cached_tokens"]))
    lines.append(_row("Cache hit rate (%):", 100.0 * m["cache_hit_rate"]))
    lines.append(_row("Peak running requests:", m["peak_running_requests"]))
    for name, key in (("Mean", "mean_slots_per_running_req"), ("Peak", "peak_slots_per_running_req")):
        value = m[key]
        lines.append(_row(f"{name} mamba slots per running req:", "n/a" if value is None else float(value)))
    lines.append("=" * 50)
    return "\n".join(lines)
