"""The parent of a ``vllm serve`` engine started by :func:`parallm.integrations.vllm.serve`: it runs the server as
its child, in the session of its own that ``serve`` gives it, and ends the whole session (the server, its engine
core, its workers) when the process that called ``serve`` is gone, however it ended (SIGTERM from torchrun,
SIGKILL, an OOM kill): it checks every ``POLL_S`` seconds whether its parent changed. Run as a script (not ``-m``:
importing the parallm package would import torch for nothing):

    python _watchdog.py PARENT_PID -- SERVER_COMMAND...

It exits with the server's status when the server ends. On its parent's death it sends SIGTERM to the session,
waits up to ``GRACE_S`` seconds for the server, then SIGKILLs the session (itself included). A SIGTERM to the
watchdog (``Server.stop`` signals the whole session) waits for the server the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 20.0


def _end_session(server: subprocess.Popen) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(os.getpgid(0), signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + GRACE_S
    while server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: _watchdog.py PARENT_PID -- COMMAND...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    server = subprocess.Popen(argv[2:])
    while True:
        code = server.poll()
        if code is not None:
            return code
        if os.getppid() != parent:      # the caller died: we were handed to another parent (init, a subreaper)
            _end_session(server)
        if stopping:                    # the session was told to stop: the server got the signal too
            try:
                return server.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(os.getpgid(0), signal.SIGKILL)
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
