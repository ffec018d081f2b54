"""Stand-ins for SLURM's `srun` and `scancel` that run a job step's tasks on this machine, one per "node", for
the supervisor's SLURM backend tests (msjax.supervise.slurm). `install(bin_dir, state_dir)` writes them.

srun: takes --nodelist (minus --exclude), --ntasks, --label and --kill-on-bad-exit as SLURM does; runs `ntasks`
  copies of its command, task i in a process group of its own with SLURM_PROCID=i, SLURMD_NODENAME=node i,
  SLURM_JOB_ID and a fresh SLURM_STEP_ID; prefixes output lines with "i: " under --label; forwards SIGTERM,
  SIGCONT and SIGINT to every task's group; with --kill-on-bad-exit=1, SIGKILLs the other tasks once one exits
  non-zero; exits with the first non-zero task status (128 + S for a signal), else 0. Each call's arguments are
  appended to STATE/srun.calls, each step's process groups written to STATE/step_ID.
scancel --signal=SIG JOB.STEP: sends SIG to every process group of that step (SLURM signals every process of a
  step); appends its arguments to STATE/scancel.calls.
"""

import sys
from pathlib import Path

_SRUN = r'''
import ctypes, os, signal, subprocess, sys, threading, time
state = os.environ["FAKE_SLURM_DIR"]
args, opts = sys.argv[1:], {}
while args and args[0].startswith("-"):
    k, _, v = args.pop(0).partition("=")
    opts[k] = v
with open(os.path.join(state, "srun.calls"), "a") as f:
    f.write(" ".join(sys.argv[1:1 + len(opts)]) + "\n")
exclude = set(opts.get("--exclude", "").split(","))
nodes = [n for n in opts["--nodelist"].split(",") if n and n not in exclude]
ntasks = int(opts.get("--ntasks", len(nodes)))
assert ntasks <= len(nodes), (ntasks, nodes)
step = 0
while True:
    try:
        fd = os.open(os.path.join(state, f"step_{step}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        break
    except FileExistsError:
        step += 1
libc = ctypes.CDLL("libc.so.6", use_errno=True)
def child_setup():
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: tasks die with this srun
tasks = []
for i in range(ntasks):
    env = dict(os.environ, SLURM_PROCID=str(i), SLURMD_NODENAME=nodes[i], SLURM_STEP_ID=str(step),
               SLURM_JOB_ID=os.environ.get("SLURM_JOB_ID", "77"), SLURM_NNODES=str(ntasks))
    tasks.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=child_setup))
os.write(fd, " ".join(str(t.pid) for t in tasks).encode())
os.close(fd)
lock = threading.Lock()
def pump(i, t):
    for line in iter(t.stdout.readline, b""):
        with lock:
            sys.stdout.buffer.write((f"{i}: " if "--label" in opts else "").encode() + line)
            sys.stdout.flush()
pumps = [threading.Thread(target=pump, args=(i, t)) for i, t in enumerate(tasks)]
for p in pumps:
    p.start()
def forward(sig, frame):
    for t in tasks:
        try:
            os.killpg(t.pid, sig)
        except ProcessLookupError:
            pass
for sig in (signal.SIGTERM, signal.SIGCONT, signal.SIGINT):
    signal.signal(sig, forward)
status = 0
while any(t.poll() is None for t in tasks):
    bad = [t.returncode for t in tasks if t.returncode not in (None, 0)]
    if bad and not status:
        status = 128 - bad[0] if bad[0] < 0 else bad[0]
        if opts.get("--kill-on-bad-exit") == "1":
            forward(signal.SIGKILL, None)
    time.sleep(0.05)
for p in pumps:
    p.join()
if not status:
    bad = [t.returncode for t in tasks if t.returncode != 0]
    status = (128 - bad[0] if bad[0] < 0 else bad[0]) if bad else 0
sys.exit(status)
'''

_SCANCEL = r'''
import os, signal, sys
state = os.environ["FAKE_SLURM_DIR"]
with open(os.path.join(state, "scancel.calls"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
sig, target = signal.SIGTERM, None
for a in sys.argv[1:]:
    if a.startswith("--signal="):
        sig = getattr(signal, "SIG" + a.split("=", 1)[1])
    else:
        target = a
step = target.split(".")[1]
for pid in open(os.path.join(state, f"step_{step}")).read().split():
    try:
        os.killpg(int(pid), sig)
    except ProcessLookupError:
        pass
'''


def install(bin_dir: Path, state_dir: Path) -> dict[str, str]:
    """Writes `srun` and `scancel` into `bin_dir`; returns the environment entries that put them first on PATH
    and give them `state_dir`."""
    import os

    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    for name, body in (("srun", _SRUN), ("scancel", _SCANCEL)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM_DIR": str(state_dir)}
