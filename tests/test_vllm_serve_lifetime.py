"""``pv.serve`` engines do not outlive the process that started them (review: servers started with
``start_new_session=True`` kept running, holding RAM or GPUs, after a trainer killed by SIGTERM / SIGKILL, when no
``finally`` runs).

* A stand-in server (a small HTTP process answering ``/health`` with a child of its own, as vLLM's API server has
  its engine core), started through ``serve(..., python=<a wrapper>)`` by a parent process that is then
  SIGKILLed: every process of the server's session is gone within seconds. Cheap, no vLLM needed.
* The same with a real ``vllm serve`` engine of 2 tensor-parallel workers (vLLM's CPU build; 1-3 minutes to start
  on the shared 2-core machine): its API server, engine core and workers all end after the parent's SIGKILL.

Both check the server's log file is mode 0600 (it holds prompts).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_SERVER = textwrap.dedent('''
    import http.server, subprocess, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])    # its "engine core"

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
''')

PARENT = textwrap.dedent('''
    import sys, time
    from parallm.integrations.vllm.serve import serve
    model, python, log, timeout = sys.argv[1], sys.argv[2] or None, sys.argv[3], float(sys.argv[4])
    server = serve(model, python=python, log=log, timeout=timeout, tensor_parallel_size=int(sys.argv[5]),
                   env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                        "VLLM_LOGGING_LEVEL": "WARNING"})
    print("READY", server.process.pid, flush=True)
    time.sleep(3600)
''')


def _session(sid: int) -> list[int]:
    """The pids of the processes of session ``sid`` (from /proc)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":    # session id; zombies are gone already
            out.append(int(pid))
    return out


def _kill_parent_and_watch(tmp_path, model: str, python: str, *, tp: int, start_timeout: float):
    """Start the parent (it starts the server), wait for the server, SIGKILL the parent; the server's session
    pids before, those left after up to 60 s, and the log's mode."""
    log = str(tmp_path / "server.log")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, model, python, log, str(start_timeout), str(tp)],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT + "/src"))
    sid = None
    try:
        line = parent.stdout.readline()
        assert line.startswith("READY"), (line, open(log).read()[-3000:] if os.path.exists(log) else "")
        sid = int(line.split()[1])
        before = _session(sid)
        mode = stat.S_IMODE(os.stat(log).st_mode)
        parent.kill()                                  # SIGKILL: no finally, no atexit
        parent.wait(10)
        deadline = time.monotonic() + 60
        while _session(sid) and time.monotonic() < deadline:
            time.sleep(0.5)
        return before, _session(sid), mode
    finally:
        if parent.poll() is None:
            parent.kill()
        if sid is not None:
            try:
                os.killpg(sid, signal.SIGKILL)         # whatever is left (the failure being tested)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(120)
def test_stand_in_server_ends_with_its_killed_parent(tmp_path):
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    wrapper = tmp_path / "python"                      # the watchdog runs on Python; the server is the stand-in
    wrapper.write_text(f'#!/bin/sh\ncase "$1" in\n  *_watchdog.py) exec {sys.executable} "$@";;\nesac\n'
                       f'exec {sys.executable} {fake} "$@"\n')
    wrapper.chmod(0o755)
    before, left, mode = _kill_parent_and_watch(tmp_path, str(tmp_path), str(wrapper), tp=1, start_timeout=60)
    assert len(before) >= 2, before                    # the server and its child (and the watchdog)
    assert left == [], f"processes of the server's session still running 60 s after the parent's SIGKILL: {left}"
    assert mode == 0o600, oct(mode)


@pytest.mark.timeout(600)
def test_vllm_server_ends_with_its_killed_parent(tmp_path):
    if os.environ.get("PARALLM_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/test.sh runs this file in .venv-vllm)")
    import vllm_engines as ve
    from parallm.integrations.vllm.serve import remove_shm_files, shm_files
    ckpt = ve.checkpoint(str(tmp_path / "ckpt"), "qwen2", 3, num_hidden_layers=1, intermediate_size=96)
    shm = shm_files()
    try:
        before, left, mode = _kill_parent_and_watch(tmp_path, ckpt, "", tp=2, start_timeout=480)
    finally:
        remove_shm_files(shm)
    assert len(before) >= 4, before                    # watchdog, API server, engine core, 2 workers
    assert left == [], f"processes of the server's session still running 60 s after the parent's SIGKILL: {left}"
    assert mode == 0o600, oct(mode)
