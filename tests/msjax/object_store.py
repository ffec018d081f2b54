"""Real object-storage servers for the tests, each in its own process on a free loopback port, stopped when the
`with` block ends (or the test fails):

- `S3Server`: moto's standalone server (`python -m moto.server`, the dev extra), which speaks the S3 REST protocol.
- `GCSServer`: gcp-storage-emulator (dev extra), which speaks the GCS JSON API that gcsfs uses.

    with S3Server() as store:
        bucket = store.make_bucket("ckpt")                      # "s3://ckpt"
        cfg = ... {"checkpoint.dir": f"{bucket}/run1", **store.overrides()} ...

Both keep everything in memory. Entering configures msjax.paths for this process (and, for S3, sets the
credentials moto wants in os.environ, restored on exit; subprocesses inherit them).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from msjax import paths
from msjax.config import StorageConfig

# Credentials moto accepts (it checks their presence, not their value); s3fs reads them from the environment.
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "msjax-test", "AWS_SECRET_ACCESS_KEY": "msjax-test-secret"}
S3_REGION = "us-west-2"  # not us-east-1: s3fs sends a LocationConstraint when it creates a bucket, which that refuses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    scheme = ""
    name = ""

    def __init__(self, start_timeout_s: float = 60.0, host: str = "127.0.0.1"):
        self.port = _free_port()
        self.host = host
        self.endpoint = f"http://{host}:{self.port}"
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._saved_env: dict[str, str | None] = {}

    storage: StorageConfig

    def _command(self) -> list[str]:
        raise NotImplementedError

    def overrides(self) -> dict[str, object]:
        """The config keys that point a run at this server."""
        return {f"storage.{f}": getattr(self.storage, f) for f in ("s3_endpoint", "s3_region", "gcs_endpoint")}

    def __enter__(self):
        for k, v in self._env.items():
            self._saved_env[k] = os.environ.get(k)
            os.environ[k] = v
        # The server logs every request: to a file, not a pipe nobody drains (a full pipe would stall it).
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(self._command(), stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")
                self.__exit__()
                raise RuntimeError(f"{self.name} exited with status {self._proc.returncode}: {err[-2000:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=1.0):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise TimeoutError(f"{self.name} did not accept connections on {self.host}:{self.port} within "
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

    def make_bucket(self, name: str) -> str:
        """Creates bucket `name`; returns its URL (`s3://name` or `gs://name`)."""
        paths.configure(self.storage)
        fs, _ = paths.filesystem(f"{self.scheme}://{name}")
        fs.mkdir(name)
        return f"{self.scheme}://{name}"


class S3Server(_Server):
    """moto's server; `storage` reaches it (endpoint and region). `host`: the address it listens on (another
    network namespace's processes reach it there, e.g. the SLURM test cluster's controller address)."""

    scheme, name = "s3", "moto_server"

    def __init__(self, start_timeout_s: float = 60.0, host: str = "127.0.0.1"):
        super().__init__(start_timeout_s, host)
        self.storage = StorageConfig(s3_endpoint=self.endpoint, s3_region=S3_REGION, timeout_s=30.0)
        self._env = dict(S3_CREDENTIALS)

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]


class GCSServer(_Server):
    """gcp-storage-emulator, in memory; `storage` reaches it (msjax.paths then sends no credentials).

    Args:
      byte_exact: run it with its multipart parser made byte-exact (gcs_emulator.py says why); False runs the
        emulator as released, which stores an object uploaded in one request one byte short when its last byte is
        a carriage return.
    """

    scheme, name = "gs", "gcp-storage-emulator"

    def __init__(self, start_timeout_s: float = 60.0, byte_exact: bool = True):
        super().__init__(start_timeout_s)
        self.byte_exact = byte_exact
        self.storage = StorageConfig(gcs_endpoint=self.endpoint, timeout_s=30.0)

    def _command(self) -> list[str]:
        program = [str(Path(__file__).with_name("gcs_emulator.py"))] if self.byte_exact else ["-m",
                                                                                              "gcp_storage_emulator"]
        return [sys.executable, *program, "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory",
                "--quiet"]
