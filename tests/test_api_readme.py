"""The README's OpenAI quickstart, run as printed (free ports swapped in): the word tokenizer, the colocated
server, the front, the `curl` line and the `openai` client's snippet each work and answer text.

Why: a quickstart that has drifted from the code is the first thing a new user meets.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

from bench.measure.launch import ROOT, free_port, spawn, stop, wait_serving
from support.apifront import START_S, request


def block(marker: str) -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    return text.split(f"<!-- {marker}", 1)[1].split("```", 2)[1].split("\n", 1)[1]


def test_the_readme_http_quickstart_works_as_printed(tmp_path):
    lines = [line for line in block("http-quickstart:").splitlines() if line.strip()]
    snippet = block("http-quickstart-python")
    assert len(lines) == 4 and snippet.count("OpenAI(") == 1
    ports = {"50051": str(free_port()), "8000": str(free_port())}
    words = str(tmp_path / "words")

    def local(line: str) -> str:
        for old, new in ports.items():
            line = line.replace(f":{old}", f":{new}")
        return line.replace("/tmp/tiny-words", words).replace(".venv/bin/python", sys.executable)

    tok, decode, api, curl = (shlex.split(local(line)) for line in lines)
    assert subprocess.run(tok, cwd=ROOT, capture_output=True, text=True, timeout=120).returncode == 0
    assert os.path.basename(decode[0]) == "kvtransfer-decode" and os.path.basename(api[0]) == "kvtransfer-api"
    procs = [spawn("decode_server", decode[1:], str(tmp_path / "decode.log"))]
    try:
        wait_serving(f"127.0.0.1:{ports['50051']}", procs, timeout=180)
        procs.append(spawn("api_server", api[1:], str(tmp_path / "api.log")))
        url = f"http://127.0.0.1:{ports['8000']}"
        deadline = time.monotonic() + START_S
        while True:
            assert procs[-1].poll() is None, open(tmp_path / "api.log").read()[-3000:]
            try:
                if request("GET", f"{url}/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, open(tmp_path / "api.log").read()[-3000:]
            time.sleep(0.3)
        if shutil.which("curl"):
            out = subprocess.run(curl, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            body = json.loads(out.stdout)
        else:  # the same request, without curl on this machine
            data = json.loads(curl[curl.index("-d") + 1])
            status, body = request("POST", f"{url}/v1/completions", data)
            assert status == 200, body
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 8, body
        assert choice["text"].split() and all(w.startswith("w") for w in choice["text"].split()), body
        run = subprocess.run([sys.executable, "-c", local(snippet)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.split() and all(w.startswith("w") for w in run.stdout.split()), run.stdout
        again = subprocess.run([sys.executable, "-c", local(snippet)], capture_output=True, text=True, timeout=120)
        assert again.stdout == run.stdout  # seeded: the same draw
    finally:
        stop(procs)
