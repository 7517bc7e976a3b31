"""`python -m sglang.bench_serving` against a real server: every backend and dataset completes a few
requests with the summary's counts right, the JSONL line has the schema a report reads, and bad flags
stop the run with one sentence (no traceback); --profile leaves the server's trace."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sglang.bench_serving import main
from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=30, suite="per-commit-cpu")

SMALL = [
    "--random-input-len",
    "48",
    "--random-output-len",
    "8",
    "--random-range-ratio",
    "1",
    "--disable-tqdm",
]
# What a report reads from each JSONL line.
SCHEMA = {
    "backend": str,
    "dataset_name": str,
    "num_prompts": int,
    "completed": int,
    "failed": int,
    "duration": float,
    "total_input_tokens": int,
    "total_output_tokens": int,
    "request_throughput": float,
    "output_throughput": float,
    "mean_ttft_ms": float,
    "median_ttft_ms": float,
    "p99_ttft_ms": float,
    "mean_tpot_ms": float,
    "mean_itl_ms": float,
    "p99_e2e_latency_ms": float,
    "cache_hit_rate": float,
    "peak_running_requests": int,
    "mamba_scheduler_strategy": str,
}


class TestBenchServing(ServerTestCase):
    server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy"]

    def bench(self, *flags: str) -> dict:
        out = self.tmp / "runs.jsonl"
        out.unlink(missing_ok=True)
        rc = main(["--base-url", self.base_url, "--output-file", str(out), *flags])
        self.assertEqual(rc, 0)
        lines = out.read_text().splitlines()
        self.assertEqual(len(lines), 1, "one JSON line per run")
        return json.loads(lines[0])

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.tmp, ignore_errors=True)
        super().tearDownClass()

    def test_every_backend_completes_every_request(self) -> None:
        for backend in ("sglang", "sglang-oai", "sglang-oai-chat"):
            with self.subTest(backend=backend):
                flags = ("--backend", backend, "--num-prompts", "5", "--seed", "3", "--output-details")
                r = self.bench(*flags, *SMALL)
                self.assertEqual((r["completed"], r["failed"], r["num_prompts"]), (5, 0, 5))
                # ignore_eos and a range ratio of 1: every request generates exactly 8 tokens.
                self.assertEqual(r["total_output_tokens"], 5 * 8)
                self.assertEqual(r["output_lens"], [8] * 5)
                # Inter-token gaps: at most one per token after the first, and together no longer
                # than the time from the first token to the end of the request.
                for itl, ttft, latency in zip(r["itls"], r["ttfts"], r["latencies"], strict=True):
                    self.assertTrue(1 <= len(itl) <= 7 and all(g >= 0 for g in itl), itl)
                    self.assertTrue(0 < ttft and ttft + sum(itl) <= latency, (ttft, itl, latency))
                self.assertGreater(r["mean_itl_ms"], 0)
        self.assert_idle_accounting()

    def test_profile_traces_the_run(self) -> None:
        """Upstream's --profile: the server's profiler runs through the benchmark (in its
        SGLANG_TORCH_PROFILER_DIR, /tmp here) and writes one trace."""
        folder = Path("/tmp") / f"{self.tmp.name}-profile"
        try:
            self.bench("--profile", "--profile-output-dir", folder.name, "--profile-prefix", "bench",
                       "--num-prompts", "2", *SMALL)  # fmt: skip
            traces = list(folder.glob("bench-*-TP-0.trace.json.gz"))
            self.assertEqual(len(traces), 1, list(folder.iterdir()))
            self.assertGreater(traces[0].stat().st_size, 0)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def test_native_ids_give_exact_input_counts(self) -> None:
        r = self.bench("--tokenize-prompt", "--num-prompts", "4", "--seed", "5", *SMALL)
        self.assertEqual(r["total_input_tokens"], 4 * 48)

    def test_jsonl_schema(self) -> None:
        r = self.bench("--num-prompts", "3", "--max-concurrency", "2", "--request-rate", "50", *SMALL)
        for key, kind in SCHEMA.items():
            self.assertIsInstance(r[key], kind, key)
        self.assertEqual((r["max_concurrency"], r["request_rate"]), (2, 50.0))

    def test_shared_prefix_dataset_hits_the_cache(self) -> None:
        r = self.bench(
            "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "4",
            "--gsp-system-prompt-len", "256", "--gsp-question-len", "16", "--gsp-output-len", "4",
            "--max-concurrency", "1", "--flush-cache", "--disable-tqdm",
        )  # fmt: skip
        self.assertEqual(r["completed"], 8)
        # One at a time after a flush: the first request of each group misses, the other three hit at
        # least the 256-token prefix's last chunk boundary (the cache chunk is 64 tokens).
        self.assertGreaterEqual(r["cached_tokens"], 2 * 3 * 256)
        self.assertAlmostEqual(r["cache_hit_rate"], r["server_cache_hit_rate"], places=6)
        # Sampled while the run goes on (4 Hz), so a short run may see nothing running.
        self.assertLessEqual(r["peak_running_requests"], 1)
        if r["mean_slots_per_running_req"] is not None:
            # lazy holds one slot per running request since b07989c (the snapshot is copied out of
            # the running slot at a boundary); a sample taken while a boundary copy is in flight
            # could see a second, never more.
            self.assertTrue(1.0 <= r["mean_slots_per_running_req"] <= 2.0, r)

    def test_sharegpt_reads_a_local_file(self) -> None:
        conv = [
            {"conversations": [{"from": "human", "value": f"question {k} " * 6}, {"from": "gpt", "value": "an answer " * 5}]}
            for k in range(6)
        ]  # fmt: skip
        path = self.tmp / "sharegpt.json"
        path.write_text(json.dumps(conv))
        r = self.bench(
            "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "4",
            "--sharegpt-output-len", "6", "--disable-tqdm",
        )  # fmt: skip
        self.assertEqual((r["completed"], r["total_output_tokens"]), (4, 4 * 6))

    def bench_argv(self, num_prompts: int) -> list[str]:
        """`python -m sglang.bench_serving` against this server."""
        base = [sys.executable, "-m", "sglang.bench_serving", "--base-url", self.base_url]
        return [*base, "--num-prompts", str(num_prompts)]

    def test_the_summary_has_upstreams_rows(self) -> None:
        proc = subprocess.run(
            [*self.bench_argv(2), *SMALL],
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        for row in (
            "Successful requests:                     2",
            "Benchmark duration (s):",
            "Total input tokens:",
            "Total generated tokens:                  16",
            "Request throughput (req/s):",
            "Output token throughput (tok/s):",
            "Median TTFT (ms):",
            "P99 TPOT (ms):",
            "Mean ITL (ms):",
            "Median E2E Latency (ms):",
            "Concurrency:",
            "Cache hit rate (%):",
            "Peak mamba slots per running req:",
        ):
            self.assertIn(row, proc.stdout)

    def test_bad_flags_get_one_sentence(self) -> None:
        dead = "http://127.0.0.1:9"
        cases = [
            (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
            (["--random-range-ratio", "1.5"], "--random-range-ratio must be between 0 and 1"),
            (
                ["--backend", "sglang-oai", "--tokenize-prompt"],
                "--tokenize-prompt works with --backend sglang",
            ),
            (["--request-rate", "0"], "--request-rate must be positive"),
            (["--random-input-len", "100000"], "more than the server's limit"),
            (["--num-prompts", "0"], "--num-prompts must be a positive integer"),
            (["--base-url", dead], f"No server answers at {dead}"),
        ]
        # In this process (a subprocess each cost ~2 s of imports; the command line's wiring is the other
        # tests'): an unexpected exception would raise here and fail the test as a traceback would.
        for flags, sentence in cases:
            with self.subTest(flags=flags):
                err = io.StringIO()
                with contextlib.redirect_stderr(err):
                    try:
                        code = main(["--base-url", self.base_url, "--num-prompts", "1", *flags])
                    except SystemExit as e:  # (argparse's refusals)
                        code = e.code
                self.assertNotEqual(code, 0)
                self.assertIn(sentence, err.getvalue())
