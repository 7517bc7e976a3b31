"""`python -m sglang.bench_serving`: load a running server with a dataset's requests and print upstream's
summary (same flags and row names, for what applies here), plus the server's prefix-cache hit rate and
mamba slots per running request sampled from /get_server_info during the run.

    python -m sglang.bench_serving --backend sglang --dataset-name random --num-prompts 200 \\
        --random-input-len 512 --random-output-len 128 --request-rate 8 --output-file runs.jsonl

Nothing is downloaded: the tokenizer is the server's (or `--tokenizer`, a local folder or preset), and
sharegpt reads `--dataset-path`. A flag that cannot work stops the run with one sentence.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

import aiohttp
import requests

from sglang.benchmark.backends import BACKENDS, RequestOutput, RequestSpec, send_request
from sglang.benchmark.datasets import DATASETS, DatasetError, DatasetRow, sample_requests
from sglang.benchmark.metrics import ServerStats, compute_metrics, format_summary

WARMUP_OUTPUT_LEN = 16
# /get_server_info is polled this often during a run (each poll is a scheduler round trip: cheap, but
# not free on a 2-core machine).
STATS_INTERVAL_S = 0.25
FLUSH_TRIES = 50


class BenchError(RuntimeError):
    """The run cannot go on; one sentence for the user."""


def _server_state(base_url: str, headers: dict) -> dict[str, Any]:
    info = requests.get(base_url + "/get_server_info", headers=headers, timeout=30).json()
    return info


def _state_of(info: dict) -> dict:
    states = info.get("internal_states") or [{}]
    return states[0] or {}


def _counters(info: dict) -> tuple[int, int]:
    c = _state_of(info).get("counters") or {}
    return c.get("num_prompt_tokens_total", 0), c.get("num_cached_tokens_total", 0)


async def _sample_stats(base_url: str, headers: dict, stats: ServerStats, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while not stop.is_set():
            try:
                async with session.get(base_url + "/get_server_info", headers=headers) as resp:
                    if resp.status == 200:
                        stats.sample(_state_of(await resp.json()))
            except (aiohttp.ClientError, TimeoutError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), STATS_INTERVAL_S)
            except TimeoutError:
                pass


async def _warmup(args: Any, spec: RequestSpec, row: DatasetRow) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
        for _ in range(args.warmup_requests):
            warm = await send_request(session, spec, row, WARMUP_OUTPUT_LEN)
            if not warm.success:
                raise BenchError(f"The warmup request failed ({warm.error}); check --backend and the server.")
        if args.flush_cache:
            # Refused while a batch is still in flight (the warmup's last step may be): retry briefly.
            for _ in range(FLUSH_TRIES):
                async with session.post(spec.url + "/flush_cache", headers=spec.headers) as resp:
                    if resp.status == 200:
                        return
                    refusal = (await resp.text()).strip()
                await asyncio.sleep(0.1)
            raise BenchError(f"--flush-cache: the server kept refusing ({refusal}).")


async def _run(
    args: Any, spec: RequestSpec, rows: list[DatasetRow], stats: ServerStats
) -> tuple[list, float]:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed)
    progress = None
    if not args.disable_tqdm:
        from tqdm.asyncio import tqdm

        progress = tqdm(total=len(rows))

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(row: DatasetRow) -> RequestOutput:
            if semaphore is None:
                out = await send_request(session, spec, row)
            else:
                async with semaphore:
                    out = await send_request(session, spec, row)
            if progress is not None:
                progress.update(1)
            return out

        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_stats(spec.url, spec.headers, stats, stop))
        start = time.perf_counter()
        tasks = []
        for row in rows:
            tasks.append(asyncio.create_task(one(row)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        stop.set()
        await sampler
    if progress is not None:
        progress.close()
    return outputs, duration


def run_benchmark(args: Any) -> dict[str, Any]:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        info = _server_state(base_url, headers)
    except (requests.RequestException, ValueError):
        raise BenchError(
            f"No server answers at {base_url}; start one or pass --base-url / --host / --port."
        ) from None
    model = args.model or info.get("served_model_name") or info.get("model_path")
    tokenizer = _load_tokenizer(args.tokenizer or info.get("tokenizer_path") or model)
    rows = sample_requests(args, tokenizer, info.get("max_req_input_len", 1 << 30))
    spec = RequestSpec(
        args.backend,
        base_url,
        model,
        stream=not args.disable_stream,
        ignore_eos=not args.disable_ignore_eos,
        tokenize_prompt=args.tokenize_prompt,
        extra_body=args.extra_request_body,
        headers=headers,
    )
    stats = ServerStats()
    asyncio.run(_warmup(args, spec, rows[0]))
    before = _counters(_server_state(base_url, headers))
    if args.profile:
        _profile(base_url, headers, "/start_profile", _profile_body(args))
    outputs, duration = asyncio.run(_run(args, spec, rows, stats))
    if args.profile:
        # (a profile with num_steps or by stage may have stopped itself: "not in progress" is no error)
        _profile(base_url, headers, "/stop_profile", None, done_ok=True)
    after_info = _server_state(base_url, headers)
    after = _counters(after_info)
    stats.prompt_tokens, stats.cached_tokens = after[0] - before[0], after[1] - before[1]
    metrics = compute_metrics(outputs, duration, tokenizer, stats)
    print(format_summary(args, metrics, after_info))
    errors = [o.error for o in outputs if not o.success]
    if errors:
        print(f"{len(errors)} request(s) failed; the first error: {errors[0]}", file=sys.stderr)
    result = {
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": len(rows),
        "mamba_scheduler_strategy": after_info.get("mamba_scheduler_strategy"),
        "model": model,
        **metrics,
    }
    if args.output_details:
        result.update(
            input_lens=[o.prompt_len for o in outputs],
            output_lens=[o.output_len for o in outputs],
            ttfts=[o.ttft for o in outputs],
            latencies=[o.latency for o in outputs],
            itls=[o.itl for o in outputs],
            generated_texts=[o.generated_text for o in outputs],
            errors=[o.error for o in outputs],
        )
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


def _profile_body(args: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"activities": args.profile_activities}
    for field, value in (("num_steps", args.profile_num_steps), ("profile_prefix", args.profile_prefix),
                         ("output_dir", args.profile_output_dir)):  # fmt: skip
        if value is not None:
            body[field] = value
    if args.profile_by_stage:
        body["profile_by_stage"] = True
        if args.profile_stages:
            body["profile_stages"] = args.profile_stages
    return body


def _profile(base_url: str, headers: dict, route: str, body: dict | None, done_ok: bool = False) -> None:
    """The server's profiler (upstream's --profile): traces land in its SGLANG_TORCH_PROFILER_DIR."""
    resp = requests.post(base_url + route, json=body or {}, headers=headers, timeout=600)
    if resp.ok or (done_ok and "not in progress" in resp.text):
        print(f"{route}: {resp.text.strip()}")
        return
    raise BenchError(f"{route} failed ({resp.status_code}): {resp.text.strip()}")


def _load_tokenizer(path: str) -> Any:
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    try:
        return get_tokenizer(path)
    except (OSError, ValueError) as e:
        raise BenchError(f"--tokenizer {path!r} cannot be loaded locally: {str(e).splitlines()[0]}") from None


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {text!r}")
        return value

    return parse


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--extra-request-body must be a JSON object, got {text!r}")
    return value


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang.bench_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="sglang", choices=list(BACKENDS))
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--model", default=None, help="Model name sent to the OpenAI routes; default: the server's."
    )
    p.add_argument(
        "--tokenizer", default=None, help="Local tokenizer folder or preset; default: the server's."
    )
    p.add_argument("--dataset-name", default="random", choices=DATASETS)
    p.add_argument("--dataset-path", default="", help="A local ShareGPT JSON file (sharegpt).")
    p.add_argument("--num-prompts", type=_positive_int("--num-prompts"), default=1000)
    p.add_argument("--sharegpt-output-len", type=_positive_int("--sharegpt-output-len"), default=None)
    p.add_argument("--random-input-len", type=_positive_int("--random-input-len"), default=1024)
    p.add_argument("--random-output-len", type=_positive_int("--random-output-len"), default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--gsp-num-groups", type=_positive_int("--gsp-num-groups"), default=64)
    p.add_argument("--gsp-prompts-per-group", type=_positive_int("--gsp-prompts-per-group"), default=16)
    p.add_argument("--gsp-system-prompt-len", type=_positive_int("--gsp-system-prompt-len"), default=2048)
    p.add_argument("--gsp-question-len", type=_positive_int("--gsp-question-len"), default=128)
    p.add_argument("--gsp-output-len", type=_positive_int("--gsp-output-len"), default=256)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Requests per second (Poisson).")
    p.add_argument("--max-concurrency", type=_positive_int("--max-concurrency"), default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="Append one JSON line per run.")
    p.add_argument("--output-details", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--tokenize-prompt", action="store_true", help="Send token ids (--backend sglang only).")
    p.add_argument("--extra-request-body", type=_json_object, default={})
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="Seconds one request may take.")
    p.add_argument("--profile", action="store_true", help="Trace the run with the server's torch profiler.")
    activities = ["CPU", "GPU", "MEM", "CUDA_PROFILER"]
    p.add_argument("--profile-activities", nargs="+", default=["CPU", "GPU"], choices=activities)
    p.add_argument("--profile-num-steps", type=_positive_int("--profile-num-steps"), default=None)
    p.add_argument("--profile-by-stage", action="store_true")
    p.add_argument("--profile-stages", nargs="+", default=None, choices=["prefill", "decode"])
    p.add_argument("--profile-prefix", default=None)
    p.add_argument("--profile-output-dir", default=None, help="Inside the server's SGLANG_TORCH_PROFILER_DIR")
    return p


def check_args(args: Any) -> None:
    if not 0.0 <= args.random_range_ratio <= 1.0:
        raise BenchError(f"--random-range-ratio must be between 0 and 1, got {args.random_range_ratio}.")
    if not args.request_rate > 0:
        raise BenchError(f"--request-rate must be positive (inf: all at once), got {args.request_rate}.")
    if args.tokenize_prompt and args.backend != "sglang":
        raise BenchError(f"--tokenize-prompt works with --backend sglang only, not {args.backend}.")
    if args.warmup_requests < 0:
        raise BenchError(f"--warmup-requests must be 0 or more, got {args.warmup_requests}.")


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        check_args(args)
        run_benchmark(args)
    except (BenchError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
