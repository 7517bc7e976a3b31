"""A sweep of feature combinations: every pair of features either serves or is refused at start in one
sentence naming a flag; never a crash, a traceback in the log or a hang.

    python -m sglang.test.combo_sweep                      # every pair (~24 min on 2 shared cores)
    python -m sglang.test.combo_sweep --features lazy,page16,kv_fp8,hicache
    python -m sglang.test.combo_sweep --with tp2 --json out.json --log-dir /tmp/sweep
    python -m sglang.test.combo_sweep --also no_buffer --skip tp2   # the triples no_buffer x A x B
    python -m sglang.test.combo_sweep --with nemotron,lfm2          # another architecture's pairs
    python -m sglang.test.combo_sweep --models --features lazy,page16,hicache,ngram   # every preset's
    python -m sglang.test.combo_sweep --list

Each case starts an offline `sglang.Engine` on a tiny preset with the server flags of its features, one
engine at a time, and sends the same requests: a greedy prompt of ~300 tokens with logprobs (top 3); four
other prompts (~1,300 tokens: with `small_pool` they push the first one's pages off the device, to the
host tier with `hicache`); the first prompt again (a prefix hit: the cold request's tokens), and once more
streamed with logprobs (its last chunk holds the cold request's tokens, a logprob per token); a sampled
request with n=2; a json_schema request; an image request on the vision-language preset. Request-level
features (logprobs, structured outputs, n>1, sampling) are thus in every case. Outcome per case:

- OK: every request served with a finish reason and consistent token counts, the hit's tokens equal the
  cold request's, and, where every feature of the case is exact, the greedy tokens equal those of the
  preset's engine without features.
- REFUSED: the start failed with one sentence naming a flag (ServerArgsError, or the scheduler's flag
  error); REFUSED_REQ: it started and refused some request with a RequestError (a 400 over HTTP).
- WRONG: served, but tokens differ where they must not.
- BROKEN: any other exception, a traceback in the log (the engine's children log to the same stderr,
  captured per case), or no start or reply within the timeouts.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BASE_MODEL = "tiny-qwen3-next"
# Small pools: the allocation of the default (all the memory there is) costs seconds per start.
BASE_ARGS = dict(max_total_tokens=4096, max_mamba_cache_size=64, max_running_requests=8, log_level="info")
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
GREEDY = {"max_new_tokens": 8, "temperature": 0}
SAMPLED = {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9, "n": 2, "sampling_seed": 3}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
STRUCTURED = {"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door. "
) * 3
PROMPT_2 = "Once upon a time there was a little server that answered every request it was given. " * 2
# Between the cold request and its hit: ~1,300 tokens of other prompts, which push the first prompt's
# pages and checkpoints off a small pool (`small_pool`; to the host tier with `hicache`).
PRESSURE = [f"Chapter {i}. " + PROMPT_2 * 4 for i in range(4)]
TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class Feature:
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Features of one group set the same flag (or the model): never paired with each other.
    group: str | None = None
    # Greedy tokens equal the same preset's engine without features (no change of numerics).
    exact: bool = True
    env: dict[str, str] = field(default_factory=dict)


FEATURES = [
    Feature("no_buffer", dict(mamba_scheduler_strategy="no_buffer"), group="strategy"),
    Feature("extra_buffer", dict(mamba_scheduler_strategy="extra_buffer"), group="strategy"),
    Feature("lazy", dict(mamba_scheduler_strategy="extra_buffer_lazy"), group="strategy"),
    Feature("page16", dict(page_size=16)),
    Feature("chunked", dict(chunked_prefill_size=64), group="chunk"),
    # Decode steps ride in the prefill batches (`--enable-mixed-chunk`, with chunks of 64).
    Feature("mixed", dict(enable_mixed_chunk=True, chunked_prefill_size=64), group="chunk"),
    Feature("no_overlap", dict(disable_overlap_schedule=True)),
    Feature("no_radix", dict(disable_radix_cache=True)),
    Feature("small_pool", dict(max_total_tokens=1024, max_mamba_cache_size=12)),
    Feature("kv_fp8", dict(kv_cache_dtype="fp8_e4m3"), exact=False),
    Feature("quant_fp8", dict(quantization="fp8"), exact=False),
    Feature("fp8_ckpt", dict(model_path="tiny-qwen3-next-fp8"), group="model"),
    Feature("vl", dict(model_path="tiny-qwen3.5-vl"), group="model"),
    Feature("hicache", dict(enable_hierarchical_cache=True), group="hicache"),
    Feature(
        "hicache_disk", dict(enable_hierarchical_cache=True, hicache_storage_backend="file"), group="hicache"
    ),
    Feature("ngram", dict(speculative_algorithm="NGRAM"), group="spec"),
    Feature("nextn", dict(speculative_algorithm="NEXTN"), group="spec"),
    Feature("tp2", dict(tp_size=2)),
    Feature("dp2", dict(dp_size=2)),
    # A LoRA adapter made for the case's model (`make_tiny_lora`), served from the start; every request
    # of the case runs on it (`lora_path`).
    Feature("lora", exact=False),
]
# The other architectures' presets (group "model": each pairs with every feature above but the other
# models). Not in the default sweep (`--models`, or name them in --features / --with).
MODEL_FEATURES = [
    Feature(name, dict(model_path=preset), group="model")
    for name, preset in (
        ("qwen35", "tiny-qwen3.5"),
        ("qwen35_moe", "tiny-qwen3.5-moe"),
        ("nemotron", "tiny-nemotron-h"),
        ("granite", "tiny-granite-4.0-h"),
        ("falcon", "tiny-falcon-h1"),
        ("bamba", "tiny-bamba"),
        ("lfm2", "tiny-lfm2"),
        ("lfm2_moe", "tiny-lfm2-moe"),
    )
]
BY_NAME = {f.name: f for f in FEATURES + MODEL_FEATURES}


@dataclass
class Outcome:
    case: str
    status: str = "OK"
    detail: str = ""
    seconds: float = 0.0
    cached_tokens: int | None = None
    greedy: list[int] | None = None
    structured: list[int] | None = None
    log: str = ""

    def fail(self, status: str, detail: str) -> None:
        order = ["OK", "REFUSED_REQ", "REFUSED", "WRONG", "BROKEN"]
        # The first failure of the worst kind stays: later ones are usually its consequences.
        if order.index(status) > order.index(self.status) or self.status == "OK":
            self.status, self.detail = status, detail


def cases(
    features: list[Feature], must_include: set[str] = frozenset(), also: tuple[Feature, ...] = ()
) -> list[tuple[Feature, ...]]:
    """Every pair of features from different groups (and containing one of `must_include` if given),
    each with the features `also` (a strategy, for the triples strategy x A x B), by model so that each
    preset's own case runs before its pairs."""
    taken = {f.name for f in also} | {f.group for f in also if f.group}
    features = [f for f in features if f.name not in taken and f.group not in taken]
    pairs = [
        (*also, a, b)
        for a, b in itertools.combinations(features, 2)
        if (a.group is None or a.group != b.group) and (not must_include or {a.name, b.name} & must_include)
    ]
    return sorted(pairs, key=lambda p: model_of(p))


def model_of(case: tuple[Feature, ...]) -> str:
    return next((f.kwargs["model_path"] for f in case if "model_path" in f.kwargs), BASE_MODEL)


@contextlib.contextmanager
def captured_stderr(path: Path):
    """fd 2 (this process's and the children's it starts) into `path` for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _with_timeout(fn, timeout: float, on_timeout) -> Any:
    """fn() on a thread; `on_timeout()` (which must make fn return or raise) if it takes longer, then a
    TimeoutError."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        on_timeout()
        t.join(30)
        raise TimeoutError(f"no reply within {timeout:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _kill_children() -> None:
    for proc in mp.active_children():
        proc.kill()


def _check_reply(out: dict, params: dict, top: int = 0) -> str | None:
    """What is wrong with one reply's finish reason and token counts, or None."""
    meta = out["meta_info"]
    finish = meta.get("finish_reason")
    n_out = len(out["output_ids"])
    if not finish or finish.get("type") not in ("length", "stop"):
        return f"finish_reason {finish!r}"
    if meta["completion_tokens"] != n_out or n_out > params["max_new_tokens"]:
        return f"completion_tokens {meta['completion_tokens']} for {n_out} output ids"
    if finish["type"] == "length" and n_out != params["max_new_tokens"]:
        return f"finished by length after {n_out} of {params['max_new_tokens']} tokens"
    if top:
        lps = meta["output_token_logprobs"]
        if [t for _, t, _ in lps] != out["output_ids"]:
            return "output_token_logprobs do not name the output tokens"
        if (
            any(len(x) != top for x in meta["output_top_logprobs"])
            or len(meta["output_top_logprobs"]) != n_out
        ):
            return f"output_top_logprobs not {top} per token"
    return None


def _requests(engine, outcome: Outcome, is_vl: bool) -> None:
    from sglang.srt.managers.request_validation import RequestError

    hung = False

    def send(label: str, top: int = 0, **kw) -> list[dict] | None:
        nonlocal hung
        if hung:  # the engine was stopped
            return None

        def call():
            return engine.generate(**kw)

        try:
            out = _with_timeout(call, REQUEST_TIMEOUT_S, engine.shutdown)
        except RequestError as e:
            outcome.fail("REFUSED_REQ", f"{label}: {e}")
            return None
        except TimeoutError as e:
            hung = True
            outcome.fail("BROKEN", f"{label}: hang, {e}")
            return None
        except Exception as e:
            outcome.fail("BROKEN", f"{label}: {type(e).__name__}: {e}")
            return None
        outs = out if isinstance(out, list) else [out]
        params = kw["sampling_params"]
        for o, ps in zip(outs, params if isinstance(params, list) else [params] * len(outs), strict=True):
            bad = _check_reply(o, ps, top)
            if bad:
                outcome.fail("BROKEN", f"{label}: {bad}")
        return outs

    cold = send(
        "greedy", top=3, prompt=PROMPT, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3
    )
    send("pressure", prompt=PRESSURE, sampling_params=[GREEDY] * len(PRESSURE))
    hit = send("prefix hit", prompt=PROMPT, sampling_params=GREEDY)
    if cold and hit:
        outcome.greedy = cold[0]["output_ids"]
        outcome.cached_tokens = hit[0]["meta_info"]["cached_tokens"]
        if hit[0]["output_ids"] != outcome.greedy:
            outcome.fail("WRONG", f"prefix hit {hit[0]['output_ids']} != cold {outcome.greedy}")
        _stream(engine, outcome)
    sampled = send("sampled n=2", prompt=PROMPT_2, sampling_params=SAMPLED)
    if sampled is not None and len(sampled) != 2:
        outcome.fail("BROKEN", f"n=2 gave {len(sampled)} replies")
    structured = send("json_schema", prompt=PROMPT_2, sampling_params=STRUCTURED)
    if structured:
        outcome.structured = structured[0]["output_ids"]
        if structured[0]["meta_info"]["finish_reason"]["type"] == "stop":
            try:
                value = json.loads(structured[0]["text"])
                assert isinstance(value, dict) and isinstance(value["a"], int)
            except Exception:
                outcome.fail(
                    "WRONG", f"json_schema reply {structured[0]['text']!r} does not match the schema"
                )
    if is_vl:
        from sglang.test.vl_checks import PLACEHOLDER, b64_png, random_image

        image = b64_png(random_image(0, 64, 64))
        send("image", prompt=f"Look at {PLACEHOLDER} then say", image_data=[image], sampling_params=GREEDY)


def _stream(engine, outcome: Outcome) -> None:
    """The first prompt once more, streamed with logprobs: its last chunk's (cumulative) tokens are the
    cold request's, and its chunks' logprobs (each only what is new) one per token."""
    from sglang.srt.managers.request_validation import RequestError

    def call():
        chunks = engine.generate(prompt=PROMPT, sampling_params=GREEDY, stream=True, return_logprob=True)
        return list(chunks)

    try:
        chunks = _with_timeout(call, REQUEST_TIMEOUT_S, engine.shutdown)
    except RequestError as e:
        outcome.fail("REFUSED_REQ", f"stream: {e}")
        return
    except Exception as e:
        outcome.fail("BROKEN", f"stream: {type(e).__name__}: {e}")
        return
    if not chunks:
        outcome.fail("BROKEN", "stream: no chunk")
        return
    tokens = chunks[-1]["output_ids"]
    logprobs = sum(len(c["meta_info"].get("output_token_logprobs") or []) for c in chunks)
    if chunks[-1]["meta_info"].get("finish_reason") is None:
        outcome.fail("BROKEN", "stream: the last chunk has no finish_reason")
    elif tokens != outcome.greedy:
        outcome.fail("WRONG", f"stream {tokens} != cold {outcome.greedy}")
    elif logprobs != len(tokens):
        outcome.fail("BROKEN", f"stream: {logprobs} output logprobs over its chunks for {len(tokens)} tokens")


def run_case(case: tuple[Feature, ...], log_dir: Path) -> Outcome:
    """Start an engine with the features' flags, send the requests, classify."""
    import sglang
    from sglang.srt.server_args_checks import ServerArgsError

    name = "+".join(f.name for f in case) or f"base({model_of(case)})"
    outcome = Outcome(name)
    kwargs = dict(BASE_ARGS, model_path=model_of(case))
    env: dict[str, str] = {}
    for f in case:
        kwargs.update(f.kwargs)
        env.update(f.env)
    log_path = log_dir / f"{name}.log"
    t0 = time.monotonic()
    with (
        tempfile.TemporaryDirectory() as disk,
        captured_stderr(log_path),
        _environ(dict(env, SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=disk)),
    ):
        engine = None
        try:
            if any(f.name == "lora" for f in case):
                from sglang.tools.make_tiny_lora import make_tiny_lora

                kwargs["lora_paths"] = [f"a={make_tiny_lora(model_of(case), Path(disk) / 'lora', seed=1)}"]
            engine = _with_timeout(lambda: sglang.Engine(**kwargs), START_TIMEOUT_S, _kill_children)
        except ServerArgsError as e:
            outcome.fail("REFUSED", str(e))
        except Exception as e:
            msg = str(e)
            # The scheduler's flag errors come as they are; its other failures start "The ... process".
            refused = type(e).__name__ == "ServerStartupError" and "--" in msg and not msg.startswith("The ")
            outcome.fail("REFUSED" if refused else "BROKEN", f"start: {type(e).__name__}: {msg}")
        if engine is not None:
            try:
                client = _OnAdapter(engine, "a") if "lora_paths" in kwargs else engine
                _requests(client, outcome, "vl" in name or model_of(case) == "tiny-qwen3.5-vl")
            finally:
                try:
                    _with_timeout(engine.shutdown, 60, _kill_children)
                except Exception as e:
                    outcome.fail("BROKEN", f"shutdown: {type(e).__name__}: {e}")
        _kill_children()
    outcome.seconds = time.monotonic() - t0
    outcome.log = log_path.read_text(errors="replace")
    if TRACEBACK in outcome.log:
        head = outcome.log[outcome.log.index(TRACEBACK) :].splitlines()
        outcome.fail(
            "BROKEN", "traceback in the log: " + " | ".join(head[-3:] if len(head) < 40 else head[:40][-3:])
        )
    return outcome


class _OnAdapter:
    """An engine whose every generate call names LoRA adapter `name`."""

    def __init__(self, engine, name: str):
        self.engine, self.name = engine, name

    def generate(self, **kw):
        return self.engine.generate(lora_path=self.name, **kw)

    def shutdown(self) -> None:
        self.engine.shutdown()


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compare_to_baseline(outcome: Outcome, case: tuple[Feature, ...], base: Outcome | None) -> None:
    if base is None or outcome.status not in ("OK", "REFUSED_REQ") or not all(f.exact for f in case):
        return
    for what, got, want in (
        ("greedy", outcome.greedy, base.greedy),
        ("json_schema", outcome.structured, base.structured),
    ):
        if got is not None and want is not None and got != want:
            outcome.fail("WRONG", f"{what} tokens {got} != the preset's without features {want}")


def sweep(
    features: list[Feature],
    must_include: set[str] = frozenset(),
    also: tuple[Feature, ...] = (),
    log_dir: Path | None = None,
    echo=print,
) -> list[Outcome]:
    """Run every case serially; `echo` gets one table row per case as it finishes."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="combo_sweep_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "1")
    os.environ.setdefault("SGLANG_ENABLE_STRICT_TP_TOKEN_CHECK", "1")
    baselines: dict[str, Outcome] = {}
    results = []
    echo(f"logs: {log_dir}")
    echo(_row("case", "status", "secs", "cached", "detail"))
    for case in cases(features, must_include, also):
        model = model_of(case)
        if model not in baselines:
            # The preset's own case: no feature but `also` and the one that picks the model.
            picks = tuple(
                f for f in FEATURES + MODEL_FEATURES if f.kwargs.get("model_path") == model and f not in also
            )
            base = run_case((*also, *picks), log_dir)
            baselines[model] = base
            results.append(base)
            echo(_format(base))
        outcome = run_case(case, log_dir)
        compare_to_baseline(outcome, case, baselines[model])
        results.append(outcome)
        echo(_format(outcome))
    return results


def _row(*cols: str) -> str:
    return f"{cols[0]:<28} {cols[1]:<11} {cols[2]:>5} {cols[3]:>6}  {cols[4]}"


def _format(o: Outcome) -> str:
    cached = "-" if o.cached_tokens is None else str(o.cached_tokens)
    return _row(o.case, o.status, f"{o.seconds:.0f}", cached, o.detail[:300])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--features", help="Comma-separated feature names (default: all; see --list).")
    p.add_argument("--skip", default="", help="Comma-separated feature names to leave out.")
    p.add_argument(
        "--with", dest="with_", default="", help="Only the pairs that contain one of these features."
    )
    p.add_argument(
        "--also",
        default="",
        help="Features added to every case (e.g. a strategy: its triples with each pair).",
    )
    p.add_argument(
        "--models",
        action="store_true",
        help="Also every pair of each other architecture's preset (see --list) with the features.",
    )
    p.add_argument("--list", action="store_true", help="List the features and their flags, then exit.")
    p.add_argument("--json", help="Write every outcome (without logs) to this file.")
    p.add_argument("--log-dir", help="Keep each case's log here (default: a new temporary folder).")
    args = p.parse_args(argv)
    if args.list:
        for f in FEATURES + MODEL_FEATURES:
            print(f"{f.name:<14} {f.kwargs}" + ("" if f.exact else "  (changes numerics)"))
        return 0
    names = args.features.split(",") if args.features else [f.name for f in FEATURES]
    if args.models:
        names += [f.name for f in MODEL_FEATURES if f.name not in names]
    skip = set(filter(None, args.skip.split(",")))
    with_ = set(filter(None, args.with_.split(",")))
    also = [n for n in args.also.split(",") if n]
    unknown = (set(names) | skip | with_ | set(also)) - set(BY_NAME)
    if unknown:
        p.error(f"unknown feature(s) {', '.join(sorted(unknown))}; see --list")
    names += [n for n in with_ if BY_NAME[n] in MODEL_FEATURES and n not in names]
    chosen = [BY_NAME[n] for n in names if n not in skip]
    results = sweep(
        chosen, with_, tuple(BY_NAME[n] for n in also), Path(args.log_dir) if args.log_dir else None
    )
    return report(results, args.json)


def report(results: list[Outcome], json_path: str | None = None) -> int:
    """Print the count of each outcome, write every outcome (without logs) to `json_path` if given; the
    exit status: 1 if a case is WRONG or BROKEN."""
    counts = {
        s: sum(o.status == s for o in results) for s in ("OK", "REFUSED_REQ", "REFUSED", "WRONG", "BROKEN")
    }
    print(", ".join(f"{k} {v}" for k, v in counts.items()))
    if json_path:
        rows = [{k: v for k, v in vars(o).items() if k != "log"} for o in results]
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return 1 if counts["WRONG"] or counts["BROKEN"] else 0


if __name__ == "__main__":
    sys.exit(main())
