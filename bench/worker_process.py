"""A bench row's worker process: commands in on its stdin, JSON replies out on its stdout (bench/runtime.py and
bench/serve.py). Standard library only: vLLM's venv runs serve.py's vLLM worker.

A worker loads, compiles and warms its engine up once, then answers the driver's commands, so the driver can time
every row in interleaved rounds (the host's speed drifts by a third within minutes here).
"""

from __future__ import annotations

import json
import subprocess
import tempfile

REPLY = "@@bench "  # marks the worker's replies among whatever else the libraries print


def reply(message: dict) -> None:
    """In the worker: one reply to the driver."""
    print(REPLY + json.dumps(message), flush=True)


class WorkerProcess:
    """The driver's handle on one worker process, ``argv`` run with ``env``; its stderr kept for the error."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name, self.log = name, tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )

    def ask(self, command: str | None) -> dict:
        """The reply to ``command`` (None: the next reply, as the first, "ready"); RuntimeError where it exited."""
        if command is not None:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
        code = self.process.wait()
        self.log.seek(0)
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"  # SIGKILL (9): out of memory?
        raise RuntimeError(f"{self.name}: the worker exited ({how})\n{self.log.read()[-3000:]}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
