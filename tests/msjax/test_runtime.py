"""Process set-up (msjax/runtime.py): malloc keeps freed large buffers, caches live in the user's cache dir."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Allocates and frees a 64 MiB buffer 20 times, touching every page, and prints the minor page faults that took.
# With glibc defaults each allocation is a fresh mmap (64 MiB > the dynamic mmap threshold's 32 MiB cap) and
# faults all 16,384 pages in again; with msjax's mallopt the freed block stays in the heap and is reused.
_FAULTS = r"""
import ctypes, resource, sys
if sys.argv[1] == "msjax":
    import msjax
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 64 << 20
def once():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    once()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, tmp_path: Path) -> int:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "MSJAX_COMPILATION_CACHE": "0"}
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_import_msjax_stops_malloc_returning_large_buffers_to_the_os(tmp_path):
    plain, tuned = _faults("plain", tmp_path), _faults("msjax", tmp_path)
    pages = 20 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert plain >= 0.9 * pages, plain  # the default really does fault every page back in
    assert tuned < 0.05 * pages, tuned


def test_caches_default_to_the_xdg_cache_dir(tmp_path):
    """A jitted function's executable lands in $XDG_CACHE_HOME/msjax/jax and the token cache in .../tokens; the
    working directory stays clean."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world, a tiny corpus for the char tokenizer\n" * 50)
    work = tmp_path / "cwd"
    work.mkdir()
    code = f"""
import json, jax, jax.numpy as jnp
from msjax.config import DataConfig
from msjax.data import prepare_data
ds = prepare_data(DataConfig(paths=({str(corpus)!r},), tokenizer="char"))
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()
print(json.dumps({{"cache": jax.config.jax_compilation_cache_dir, "tokens": ds.meta["cache_path"]}}))
"""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    env.pop("MSJAX_CACHE_HOME", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=work, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cache"] == str(tmp_path / "xdg" / "msjax" / "jax")
    assert any((tmp_path / "xdg" / "msjax" / "jax").iterdir()), "no executable was written to the cache"
    assert Path(got["tokens"]).parent == tmp_path / "xdg" / "msjax" / "tokens"
    assert list(work.iterdir()) == []
