"""A real S3-compatible server for the tests: moto's standalone server (`moto[server]`, the dev extra), on a free
loopback port, in its own process, stopped when the `with` block ends (or the test fails).

    with S3Server() as s3:
        s3.make_bucket("ckpt")
        cfg = ... "checkpoint.dir": f"s3://ckpt/run1", "storage.s3_endpoint": s3.endpoint ...

It speaks the S3 REST protocol over HTTP, so s3fs (msjax's path layer) and any other S3 client talk to it as they
would to AWS; it keeps everything in memory.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

from msjax import paths
from msjax.config import StorageConfig

# Credentials moto accepts (it checks their presence, not their value); s3fs reads them from the environment.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "msjax-test", "AWS_SECRET_ACCESS_KEY": "msjax-test-secret"}
REGION = "us-west-2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's server on 127.0.0.1:<free port>. `endpoint` is its URL; `storage` a StorageConfig that reaches it.

    Entering sets the credentials in os.environ (and configures msjax.paths for this process); leaving stops the
    server (SIGTERM, then SIGKILL after 10 s) and restores the environment.
    """

    def __init__(self, start_timeout_s: float = 60.0):
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.storage = StorageConfig(s3_endpoint=self.endpoint, s3_region=REGION, timeout_s=30.0)
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._saved_env: dict[str, str | None] = {}

    def __enter__(self) -> "S3Server":
        for k, v in CREDENTIALS.items():
            self._saved_env[k] = os.environ.get(k)
            os.environ[k] = v
        # The server logs every request: to a file, not a pipe nobody drains (a full pipe would stall it).
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                      stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")
                self.__exit__()
                raise RuntimeError(f"moto_server exited with status {self._proc.returncode}: {err[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise TimeoutError(f"moto_server did not accept connections on 127.0.0.1:{self.port} within "
                                       f"{self.start_timeout_s:.0f} s")
                time.sleep(0.1)
        paths.configure(self.storage)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None:
            self._log.close()
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        paths.configure(StorageConfig())

    def env(self) -> dict[str, str]:
        """The environment a subprocess needs to reach this server (credentials; the endpoint goes in its config)."""
        return {**os.environ, **CREDENTIALS}

    def make_bucket(self, name: str) -> str:
        """Creates bucket `name`; returns its URL `s3://name`."""
        paths.configure(self.storage)
        fs, _ = paths.filesystem(f"s3://{name}")
        fs.mkdir(name)
        return f"s3://{name}"
