"""`hf-kvcache serve` in a subprocess on 127.0.0.1, as the HTTP tests and `eval/bench_serve_http.py` drive it: a free
port, a bounded start (GET /health), the `openai` client, GET /v1/kv_cache, raw POSTs (to see status codes), and a
stop that always ends the process (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`hf-kvcache serve --host 127.0.0.1 --port PORT FLAGS...`; raises RuntimeError (with the server's output) when
    it does not answer /health within `start_timeout` seconds. `launcher`: the command standing for `hf-kvcache`
    (the tests' fault-injecting one), `python -m hf_kvcache.cli` by default."""

    def __init__(
        self, *flags: str, start_timeout: float = 240, request_timeout: float = 120, launcher: list[str] | None = None
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.request_timeout = request_timeout
        command = [
            *(launcher or [sys.executable, "-m", "hf_kvcache.cli"]),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
        ]
        # the output goes to a file: a pipe nobody reads fills up and blocks the server's logging (uvicorn logs
        # every request)
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (open for the server's life; closed by stop())
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + start_timeout
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"hf-kvcache serve {' '.join(flags)} did not start within {start_timeout} s:\n"
                    f"{self.output()[-3000:]}"
                )
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def openai_client(self, **kwargs):
        """An `openai.OpenAI` client for this server (no retries: a failure is a result)."""
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1", api_key="none", timeout=self.request_timeout, max_retries=0, **kwargs
        )

    def kv_cache(self) -> dict:
        """GET /v1/kv_cache (hf_kvcache.paged.server.kv_cache_state)."""
        with urllib.request.urlopen(self.url + "/v1/kv_cache", timeout=10) as response:
            return json.load(response)

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        """(HTTP status, JSON answer) of a POST, error statuses included."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as error:
            return error.code, json.load(error)

    def output(self) -> str:
        """What the server printed so far."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
