"""Run a command as a CPU without AMX would: `python scripts/refuse_amx.py COMMAND [ARGS...]`.

    python scripts/refuse_amx.py python scripts/bench.py --recipe --config=shakespeare_char ...
    python scripts/refuse_amx.py python -c "from msjax.hardware import measured_cpu_matmul_flops as m; \\
        print(m(dtype='float32'), m(dtype='bfloat16'))"

On a CPU with AMX (Intel Sapphire Rapids and later) a Linux process asks the kernel for the AMX tile data state
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, Linux 5.16+) before its first tile instruction. This
script installs a seccomp filter that answers that one request with EPERM, then replaces itself with COMMAND; the
filter holds for COMMAND and every process it starts (seccomp filters survive fork and exec). Everything else runs
as before. msjax's `model.matmul_dtype=auto` (`msjax.hardware.cpu_amx_bf16_usable`) and XLA:CPU's matmul
libraries ask before they use AMX and, refused, take the paths of a CPU without it: float32 weight matmuls, and
the AVX-512 kernels an AMD Zen 4 or an Intel Xeon before Sapphire Rapids runs.

Why it exists: msjax's CPU speed is judged on every kind of machine it may get, and a development machine's kind
cannot be chosen; this measures the code paths of an AVX-512 CPU without AMX on an AMX machine. What it does not
give: another CPU's clock, caches and per-instruction throughput (a Zen 4 executes 512-bit operations on 256-bit
units), or the absence of this CPU's other AVX-512 extensions (AVX-512-FP16 stays). PyTorch's float32 matmuls
(MKL, oneDNN) use no AMX, so a reference run beside it is unchanged.

Exit status: COMMAND's own; 2 for a missing COMMAND or where the filter cannot be installed (not Linux on
x86-64, or a kernel without seccomp filters); 127 for a COMMAND that cannot be run.
"""

from __future__ import annotations

import ctypes
import os
import sys

# The request refused, from Linux's arch/x86/include/uapi/asm/prctl.h and asm/unistd_64.h (msjax.hardware has the
# same two: this script imports no msjax, whose process set-up would change the environment COMMAND inherits).
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023

# Classic BPF over `struct seccomp_data` (linux/seccomp.h): nr at byte 0, arch at 4, args[0] at 16 (its low word:
# x86-64 is little-endian, and arch_prctl's codes fit 32 bits).
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_NR, _ARCH, _ARG0 = 0, 4, 16
_AUDIT_ARCH_X86_64 = 0xC000003E
_RET_ALLOW, _RET_EPERM = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, _PR_SET_NO_NEW_PRIVS = 22, 2, 38


class _Instruction(ctypes.Structure):  # struct sock_filter
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Instruction))]


def refuse_amx() -> None:
    """Installs, in this process, a seccomp filter under which `arch_prctl(ARCH_REQ_XCOMP_PERM, ...)` fails with
    EPERM; every other system call is allowed. The filter cannot be removed and passes to every child.

    Raises:
      OSError: not Linux on x86-64, or the kernel refused the filter (errno as the kernel gave it).
    """
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise OSError(f"refuse_amx: AMX permission requests exist only on Linux x86-64, not {sys.platform} "
                      f"{os.uname().machine}")
    program = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),  # another ABI (x32, i386 entry points): not ours to judge
        (_RET_K, 0, 0, _RET_ALLOW),
        (_LD_W_ABS, 0, 0, _NR),
        (_JEQ_K, 0, 3, SYS_ARCH_PRCTL),
        (_LD_W_ABS, 0, 0, _ARG0),
        (_JEQ_K, 0, 1, ARCH_REQ_XCOMP_PERM),
        (_RET_K, 0, 0, _RET_EPERM),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    instructions = (_Instruction * len(program))(*(_Instruction(*i) for i in program))
    fprog = _Program(len(program), instructions)
    libc = ctypes.CDLL(None, use_errno=True)
    # No-new-privileges is what lets an unprivileged process install a filter; it also keeps set-uid binaries
    # from gaining rights under it.
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"refuse_amx: the kernel refused the seccomp filter: {os.strerror(errno)}")


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: refuse_amx.py COMMAND [ARGS...] (--help: what it does)", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        refuse_amx()
    except OSError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"refuse_amx: cannot run {argv[0]!r}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
