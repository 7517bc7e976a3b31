"""Nightly: tensor and data parallelism through the real server (issue 54), on CPU with gloo.

- Two "nodes" on one machine (--nnodes 2 --node-rank 0/1 --dist-init-addr 127.0.0.1:PORT, two launchers)
  serve a request with node 0's HTTP server; killing node 1 ends node 0's server with a sentence naming
  TP rank 1, and leaves no process of either node.
- Nodes started with different flags are refused at start, naming the flag.
- A killed TP rank of one node ends the server (status 1) with a sentence naming it, and no orphan.
- A wrong --dist-init-addr (nobody listens there) fails within --dist-timeout plus the start-up, with one
  sentence naming the flag.
- --dp-size 2 serves and spreads requests over both replicas.

By hand: .venv/bin/python -m pytest -q test/registered/distributed/test_tp_server_faults.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import requests

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerProcess, find_free_port

register_cpu_ci(est_time=240, suite="nightly-cpu")

MODEL = ["--model-path", "tiny-qwen3-next"]
EXIT_TIMEOUT_S = 30.0


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    kids: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        kids.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_exit(server: ServerProcess, timeout: float = EXIT_TIMEOUT_S) -> int:
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within {timeout:.0f} s:\n{server.log_text()[-3000:]}")


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def rank_pid(server: ServerProcess, rank: str) -> int:
    m = re.search(rf"the scheduler \({rank}\) \(pid (\d+)\)", server.log_text())
    assert m, server.log_text()[-3000:]
    return int(m.group(1))


def generate(server: ServerProcess, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    r = requests.post(server.base_url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.fixture
def started():
    servers: list[ServerProcess] = []
    yield servers
    for s in servers:
        s.stop()


def test_two_nodes_on_localhost_serve_and_a_lost_node_ends_the_server(started):
    addr = f"127.0.0.1:{find_free_port()}"
    common = [*MODEL, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", "120"]
    node0 = ServerProcess([*common, "--node-rank", "0"])
    node1 = ServerProcess([*common, "--node-rank", "1"])
    started += [node0, node1]
    node0.wait_ready()
    assert "Node 1 of 2: its 1 rank(s) are ready" in node1.log_text()
    assert len(generate(node0, [5, 6, 7, 8] * 4)) == 6
    info = requests.get(node0.base_url + "/get_server_info", timeout=10).json()
    assert len(info["internal_states"][0]["memory_bytes_by_rank"]) == 2
    procs = [node0.proc.pid, *descendants(node0.proc.pid), node1.proc.pid, *descendants(node1.proc.pid)]
    node1.proc.send_signal(signal.SIGKILL)  # its rank dies with it (parent-death signal)
    assert wait_exit(node0) == 1
    log = node0.log_text()
    assert re.search(r"TP rank 1 stopped answering \(.*\); TP rank 0 ends the server", log), log[-3000:]
    assert not wait_gone(procs), "processes left behind"


def test_nodes_started_with_other_flags_are_refused_naming_the_flag():
    addr = f"127.0.0.1:{find_free_port()}"
    common = [sys.executable, "-m", "sglang.launch_server", *MODEL, "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", addr, "--dist-timeout", "120", "--port", str(find_free_port())]  # fmt: skip
    node1 = subprocess.Popen(
        [*common, "--node-rank", "1", "--max-total-tokens", "5000"], stderr=subprocess.PIPE, text=True
    )
    node0 = subprocess.run([*common, "--node-rank", "0"], capture_output=True, text=True, timeout=300)
    _, node1_err = node1.communicate(timeout=120)
    sentence = "error: --max-total-tokens is 5000 on TP rank 1 but None on TP rank 0; start every node with the same flags."
    for code, err in [(node0.returncode, node0.stderr), (node1.returncode, node1_err)]:
        assert code == 1, err[-3000:]
        assert [line for line in err.splitlines() if line.startswith("error: ")] == [sentence], err[-3000:]


def test_a_killed_rank_ends_the_server_with_a_sentence_naming_it(started):
    server = ServerProcess([*MODEL, "--tp-size", "2"])
    started.append(server)
    server.wait_ready()
    assert len(generate(server, [9, 10, 11])) == 6
    procs = [server.proc.pid, *descendants(server.proc.pid)]
    os.kill(rank_pid(server, "TP rank 1"), signal.SIGKILL)
    assert wait_exit(server) == 1
    log = server.log_text()
    assert (
        "The scheduler (TP rank 1) process has exited (killed by signal 9). The server shuts down." in log
    ), log[-3000:]
    assert not wait_gone(procs), "processes left behind"


def test_a_wrong_dist_init_addr_fails_in_bounded_time():
    port = find_free_port()  # nobody listens there: rank 0 of node 0 never comes
    cmd = [sys.executable, "-m", "sglang.launch_server", *MODEL, "--tp-size", "2", "--nnodes", "2",
           "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}", "--dist-timeout", "5"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(
        f"error: TP rank 1 could not meet the other 1 rank(s) at --dist-init-addr 127.0.0.1:{port} within "
        "--dist-timeout 5 s"
    ), errors
    # The start-up (imports, on a loaded 2-core machine) plus the 5 s wait, never the default 300 s.
    assert took < 90, took


def test_dp2_serves_and_spreads_requests(started):
    server = ServerProcess([*MODEL, "--dp-size", "2"])
    started.append(server)
    server.wait_ready()
    outs = [generate(server, [5 + i, 6, 7, 8]) for i in range(6)]
    assert all(len(o) == 6 for o in outs)
    info = requests.get(server.base_url + "/get_server_info", timeout=10).json()
    per_replica = [
        s["counters"]["num_requests_total"] for s in info["internal_states"][0]["data_parallel_states"]
    ]
    # Round robin: six, alternating (the warm-up, one request per replica, counts in neither).
    assert per_replica == [3, 3], per_replica
    assert requests.post(server.base_url + "/flush_cache", timeout=10).status_code == 200
