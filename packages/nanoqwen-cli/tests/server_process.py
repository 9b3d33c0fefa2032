"""A real `nanoqwen-cli serve` process on a loopback port the OS picks, for the server tests.

The process runs the CPU reference backend on the tiny model; its output goes to a log file (a pipe
nobody reads would fill and block it) that a failing test prints.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import openai
from nanoqwen_cli.testing import argv
from prometheus_client.parser import text_string_to_metric_families

PORT_LINE = re.compile(r"on http://127\.0\.0\.1:(\d+) ")


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self):
        return json.loads(self.body)


class ServeProcess:
    def __init__(self, model: Path, home: Path, *args: str, api_key: str | None = None):
        env = dict(os.environ)
        env.update(NANOQWEN_CACHE=str(home / "cache"), HF_HOME=str(home / "hf"), HF_HUB_OFFLINE="1",
                   PYTHONUNBUFFERED="1")
        env.pop("NANOQWEN_MODEL", None)
        env.pop("NANOQWEN_API_KEY", None)
        if api_key is not None:
            env["NANOQWEN_API_KEY"] = api_key  # the environment variable, not the flag: both reach --api-key
        self.log_path = home / "serve.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [*argv(["serve"]), "--model", str(model), "--device", "cpu",
               "--port", "0", "--no-access-log", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.port = self._wait_for_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"

    def output(self) -> str:
        return self.log_path.read_text()

    def _wait_for_port(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = PORT_LINE.search(self.output())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.01)
        raise AssertionError(f"serve printed no address in {timeout} s:\n{self.output()}")

    def health_statuses(self, timeout: float = 120) -> list[int]:
        """Poll GET /health until it answers 200; every status seen, in order."""
        seen = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.output()}")
            seen.append(self.request("GET", "/health").status)
            if seen[-1] == 200:
                return seen
            time.sleep(0.02)
        raise AssertionError(f"/health not 200 after {timeout} s ({seen[-5:]}):\n{self.output()}")

    def connect(self, timeout: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body: dict | bytes | None = None,
                headers: dict | None = None) -> Answer:
        """One plain HTTP request (no OpenAI client in between): what the wire carries."""
        conn = self.connect()
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            hdrs = {"Content-Type": "application/json", **(headers or {})} if data is not None else headers or {}
            conn.request(method, path, body=data, headers=hdrs)
            r = conn.getresponse()
            return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def async_client(self, api_key: str = "unused", **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """GET /metrics as {'name{label="v",...}': value}, labels sorted."""
        out = {}
        for family in text_string_to_metric_families(self.request("GET", "/metrics").text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 120) -> dict[str, float]:
        """The metrics once no request waits or runs (what a test checks the pool against)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["nanoqwen_requests_running"] == 0 and m["nanoqwen_requests_waiting"] == 0:
                return m
            time.sleep(0.05)
        raise AssertionError(f"requests still running after {timeout} s: {m}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        """Send `sig`, wait for the exit; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"serve did not exit {timeout} s after signal {sig}:\n{self.output()}") from None
        self._log.close()
        return self.proc.returncode
