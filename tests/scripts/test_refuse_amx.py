"""scripts/refuse_amx.py runs a command whose AMX permission requests fail, and `model.matmul_dtype=auto` follows
the permission, not the CPU flag: under the refusal it keeps float32 matmuls, and a bf16 matmul peak measured there
is kept apart from the AMX one.

On a CPU with the `amx_bf16` flag the second test fails for `auto` decided by the flag alone (bfloat16 under the
refusal, where XLA:CPU's bf16 dots run on AVX-512 kernels slower than its float32 ones); on a CPU without the
flag both answers are float32 and the test proves only the refusal itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "refuse_amx.py"

# Asks for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) and for the supported set
# (ARCH_GET_XCOMP_SUPP, 0x1021, which the filter leaves alone); prints both errnos (0: granted).
PROBE = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(code, arg):
    ctypes.set_errno(0)
    return 0 if libc.syscall(158, code, arg) == 0 else ctypes.get_errno()
supported = ctypes.c_uint64()
print(json.dumps({"request": errno_of(0x1023, ctypes.c_long(18)), "supported": errno_of(0x1021, ctypes.byref(supported))}))
"""


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *command], capture_output=True, text=True, timeout=120)


def test_the_request_fails_with_eperm_in_the_command_and_in_its_children():
    nested = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {PROBE!r}], check=True, timeout=60)"
    for command in ([sys.executable, "-c", PROBE], [sys.executable, "-c", nested]):
        done = run(*command)
        assert done.returncode == 0, done.stderr
        probe = json.loads(done.stdout)
        assert probe["request"] == 1, probe  # EPERM, from the filter
        assert probe["supported"] == 0, probe  # the rest of arch_prctl untouched


def test_auto_keeps_float32_matmuls_where_amx_is_refused():
    ask = ("import json; from msjax import hardware; from msjax.ops import matmul; print(json.dumps(["
           "hardware.cpu_amx_bf16_usable(), str(matmul.resolve('auto', 'float32', platform='cpu')), "
           "hardware._cpu_key('bfloat16')]))")
    refused = run(sys.executable, "-c", ask)
    assert refused.returncode == 0, refused.stderr
    usable, dtype, bf16_key = json.loads(refused.stdout)
    assert (usable, dtype) == (False, "float32")
    assert bf16_key.endswith("| bfloat16 without AMX")  # its measured bf16 peak is not an AMX machine's

    # Without the refusal: bfloat16 exactly where the CPU has the flag and the kernel grants the tile state.
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    granted = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                                        timeout=60, check=True).stdout)["request"] == 0
    expected = "bfloat16" if "amx_bf16" in flags.split() and granted else "float32"
    plain = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    usable, dtype, key = json.loads(plain.stdout)
    assert (usable, dtype) == (expected == "bfloat16", expected)
    assert (key == bf16_key) == (not usable)


@pytest.mark.parametrize("command, status, says", [
    ((), 2, "usage: refuse_amx.py COMMAND"),
    (("no-such-command-anywhere",), 127, "cannot run 'no-such-command-anywhere'"),
])
def test_a_missing_or_unknown_command_gets_one_error(command, status, says):
    done = run(*command)
    assert done.returncode == status and says in done.stderr, (done.returncode, done.stderr)
