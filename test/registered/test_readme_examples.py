"""The README's server examples work as written: the server command starts a server, and the `curl` and
`openai`-client examples get answers from it.

They address 127.0.0.1:30000; if that port is taken on this machine, the test uses a free port instead
and rewrites the port number in the snippets (nothing else).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerProcess, find_free_port, looks_like_python

register_cpu_ci(est_time=15, suite="per-commit-cpu")

ROOT = Path(__file__).resolve().parents[2]
README_PORT = 30000


def code_blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S)


def server_examples(path: Path) -> dict[str, str] | None:
    blocks = code_blocks(path.read_text())
    found = {}
    for lang, code in blocks:
        if lang == "bash" and "sglang.launch_server" in code:
            found["server"] = code
        elif lang == "bash" and code.lstrip().startswith("curl"):
            found["curl"] = code
        elif lang == "python" and "from openai import OpenAI" in code:
            found["openai"] = code
    return found if len(found) == 3 else None


def port_is_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


DOCS = [ROOT / "README.md"]


def test_the_readme_has_the_examples():
    assert server_examples(ROOT / "README.md"), "README.md lacks the server, curl and openai examples"


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_readme_examples_run_as_written(doc: Path):
    ex = server_examples(doc)
    port = README_PORT if port_is_free(README_PORT) else find_free_port()

    def fix(code: str) -> str:
        return code.replace(str(README_PORT), str(port))

    argv = shlex.split(fix(ex["server"]).replace("\\\n", " "))
    args = argv[argv.index("sglang.launch_server") + 1 :]
    server = ServerProcess(args, port=port)
    try:
        server.wait_ready()
        curl = subprocess.run(["bash", "-c", fix(ex["curl"])], capture_output=True, text=True, timeout=120)
        assert curl.returncode == 0, curl.stderr
        reply = json.loads(curl.stdout)
        choice = reply["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        print(f"curl example's completion: {text!r}")
        assert reply["usage"]["completion_tokens"] >= 1, reply
        # The default model is the demo, which writes Python; the README shows its (greedy) answer.
        assert looks_like_python(text), text
        shown = [c for lang, c in code_blocks(doc.read_text()) if lang == "text"]
        prompt = json.loads(re.search(r"-d '(.*)'", ex["curl"]).group(1))["prompt"]
        assert shown and shown[0] == prompt + text + "\n", "the README's shown completion is out of date"
        py = subprocess.run(
            [sys.executable, "-c", fix(ex["openai"])], capture_output=True, text=True, timeout=120
        )
        assert py.returncode == 0, py.stderr
        print(f"openai example printed: {py.stdout!r}")
        assert "completion_tokens=" in py.stdout, py.stdout
        assert looks_like_python(py.stdout.split("CompletionUsage")[0]), py.stdout
    finally:
        server.stop()


def test_engine_example_runs_as_written():
    doc = ROOT / "README.md"
    code = next(c for lang, c in code_blocks(doc.read_text()) if lang == "python" and "sglang.Engine(" in c)
    py = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert py.returncode == 0, py.stderr[-3000:]
