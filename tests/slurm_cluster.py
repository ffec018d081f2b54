"""A real SLURM cluster of a few nodes on this one machine, from Debian's packages, for tests and by hand.

    python tests/slurm_cluster.py up [--nodes=3] [--dir=/tmp/msjax-slurm]   # prints the SLURM_CONF to export
    SLURM_CONF=/tmp/msjax-slurm/slurm.conf sinfo; sbatch ...
    python tests/slurm_cluster.py down [--dir=/tmp/msjax-slurm]

Needs root, iproute2, util-linux (nsenter, unshare) and the packages `slurmctld slurmd slurm-client munge` (the
project's .ci/run installs them). What it starts:
  - munged (its own key, socket and files under DIR), slurmctld in this machine's namespaces, on the address it
    gives a bridge (10.77.K.1; SlurmctldHost is this machine's host name, as slurmctld insists);
  - per node NAME (node1, node2, ...): a network namespace joined to the bridge by a veth pair, with its own
    address (10.77.K.1I), and a slurmd started in it with `nsenter --net=/run/netns/NS unshare --uts --mount`:
    its own host name (NAME) and its own /etc/hosts (bind-mounted, naming every node and the controller), so
    every task SLURM starts on the node lives in the node's network, host name and name resolution. Each node also
    mounts a tmpfs of its own at `node_local` (DIR/node-local): one path, a separate disk per node, as a host's
    /dev/shm or local NVMe; it starts empty whenever the node's slurmd is started, and the machine's own directory
    at that path stays empty. (`ip netns
    exec` is not used: it remounts /sys, and slurmd 22.05 then fails to find its cgroup filesystem.)
  - no cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none): this sandbox's cgroup mode is not one
    slurmd's cgroup plugins accept, and nothing here needs confinement.
SlurmdTimeout=10 and ReturnToService=2: a node whose slurmd is gone is "not responding" in about 14 s and DOWN in
about 27 s; a slurmd started again is idle at once. Non-default ports, so a cluster of the machine's own is not
disturbed. `down` (and the fixture's end) kills every daemon and every process left in the nodes' namespaces,
deletes the namespaces, links and bridge, and checks that nothing is left.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "sbatch", "munged", "ip", "nsenter", "unshare")


def missing_tools() -> list[str]:
    """The commands this needs that are not on PATH (an empty list: it can run)."""
    return [t for t in PACKAGES if shutil.which(t) is None]


def _run(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=60, **kw)


class SlurmCluster:
    """A cluster of `nodes` nodes (see the module docstring). `up()` starts it, `down()` removes it all.

    Args:
      root: its folder (configuration, munge key, spools, logs); created.
      nodes: how many nodes (1-9).
      cpus: CPUs each node declares (tasks are placed by these; the machine's cores are shared by all nodes).
    """

    def __init__(self, root: Path, nodes: int = 3, cpus: int = 2):
        if not 1 <= nodes <= 9:
            raise ValueError(f"nodes={nodes}: allowed is 1..9")
        self.root = Path(root).resolve()
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        tag = (self.root / "tag").read_text() if (self.root / "tag").exists() else secrets.token_hex(2)
        self.tag = tag
        # one /24 per cluster, from the tag: two clusters on one machine do not collide
        self.subnet = f"10.77.{int(tag, 16) % 250 + 1}"
        self.bridge = f"msjb{tag}"
        self.controller_addr = f"{self.subnet}.1"
        self.conf = self.root / "slurm.conf"
        self.node_local = self.root / "node-local"
        self.procs: dict[str, subprocess.Popen] = {}

    # -- names ---------------------------------------------------------------------------------------------------
    def netns(self, node: str) -> str:
        return f"msj{self.tag}{node}"

    def addr(self, node: str) -> str:
        return f"{self.subnet}.{10 + self.nodes.index(node) + 1}"

    @property
    def env(self) -> dict[str, str]:
        """The environment the client commands (sbatch, squeue, scontrol, ...) need: this cluster's SLURM_CONF."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- up ------------------------------------------------------------------------------------------------------
    def up(self, timeout_s: float = 60.0) -> "SlurmCluster":
        """Starts munged, slurmctld and one slurmd per node; returns once every node is idle.

        Raises RuntimeError naming what failed (a daemon's log tail), after removing what was started."""
        try:
            self._write_files()
            self._network()
            self._start("munged", ["munged", "--foreground", "--force", f"--socket={self.root / 'munge.socket'}",
                                   f"--key-file={self.root / 'munge.key'}", f"--pid-file={self.root / 'munged.pid'}",
                                   f"--log-file={self.root / 'munged.log'}", f"--seed-file={self.root / 'munge.seed'}"])
            self._wait(lambda: (self.root / "munge.socket").exists(), 10, "munged's socket")
            self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            for node in self.nodes:
                self.start_node(node)
            self._wait(self._all_idle, timeout_s, "every node idle (sinfo)")
        except BaseException:
            self.down()
            raise
        return self

    def _write_files(self) -> None:
        for d in ("state", "spool", "log", "node-local"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "tag").write_text(self.tag)
        key = self.root / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.root.chmod(0o755)  # munged checks that its socket's folder is not writable by others
        hosts = ["127.0.0.1 localhost", f"{self.controller_addr} {socket.gethostname()}"]
        hosts += [f"{self.addr(n)} {n}" for n in self.nodes]
        (self.root / "hosts").write_text("\n".join(hosts) + "\n")
        ports = 17000 + int(self.tag, 16) % 2000 * 2
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.addr(n)} CPUs={self.cpus} RealMemory=2000 State=UNKNOWN"
                          for n in self.nodes)
        r = self.root
        self.conf.write_text(f"""# msjax test cluster ({self.root})
ClusterName=msjax{self.tag}
SlurmctldHost={socket.gethostname()}({self.controller_addr})
SlurmctldPort={ports}
SlurmdPort={ports + 1}
AuthType=auth/munge
AuthInfo=socket={r / 'munge.socket'}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'spool'}/slurmd-%n.pid
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
SlurmdTimeout=10
ReturnToService=2
KillWait=5
MinJobAge=10
MessageTimeout=5
InactiveLimit=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.controller_addr}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            ns, host_end, node_end = self.netns(node), f"{self.netns(node)}h", f"{self.netns(node)}n"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            _run("ip", "link", "set", host_end, "master", self.bridge)
            _run("ip", "link", "set", host_end, "up")
            _run("ip", "link", "set", node_end, "netns", ns)
            for cmd in (["ip", "addr", "add", f"{self.addr(node)}/24", "dev", node_end],
                        ["ip", "link", "set", node_end, "up"], ["ip", "link", "set", "lo", "up"],
                        ["ip", "route", "add", "default", "via", self.controller_addr]):
                _run("nsenter", f"--net=/run/netns/{ns}", *cmd)

    def _start(self, name: str, argv: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("ab")
        with log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=self.env, start_new_session=True)

    def start_node(self, node: str) -> None:
        """Starts `node`'s slurmd in its namespace (again, after `kill_node`)."""
        script = (f"hostname {node} && mount --bind {self.root / 'hosts'} /etc/hosts && "
                  f"mount -t tmpfs msjax-{node}-local {self.node_local} && exec slurmd -D -N {node} -f {self.conf}")
        self._start(f"slurmd-{node}", ["nsenter", f"--net=/run/netns/{self.netns(node)}", "unshare", "--uts",
                                       "--mount", "sh", "-c", script])

    def _all_idle(self) -> bool:
        out = _run("sinfo", "-h", "-N", "-o", "%N %t", check=False, env=self.env).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    @staticmethod
    def _wait(what, timeout_s: float, desc: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {desc}")
            time.sleep(0.1)

    # -- faults --------------------------------------------------------------------------------------------------
    def node_pids(self, node: str) -> list[int]:
        """Every process in `node`'s network namespace (slurmd, its step daemons, the job's tasks)."""
        out = _run("ip", "netns", "pids", self.netns(node), check=False).stdout.split()
        return [int(p) for p in out]

    def kill_node(self, node: str) -> list[int]:
        """A node failure: SIGKILL to everything in the node's namespace, its slurmd included (SLURM then marks it
        not responding, then DOWN). Returns the pids killed."""
        pids = self.node_pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc = self.procs.pop(f"slurmd-{node}", None)
        if proc is not None:
            proc.wait(timeout=30)
        return pids

    def node_state(self, node: str) -> str:
        out = _run("sinfo", "-h", "-n", node, "-N", "-o", "%t", check=False, env=self.env).stdout.split()
        return out[0] if out else ""

    # -- down ----------------------------------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Stops everything and removes the namespaces, links and bridge. Returns what could not be removed
        (empty when nothing is left)."""
        for node in self.nodes:
            for pid in self.node_pids(node):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()
        for pid in self._daemons():  # started by another process (`up` from the command line)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for node in self.nodes:
            _run("ip", "netns", "del", self.netns(node), check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        deadline = time.monotonic() + 15  # killed processes whose parent died are reaped a little late here
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def _daemons(self) -> list[int]:
        """Live processes whose command line names this cluster's folder (its daemons)."""
        pids = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and int(proc.name) != os.getpid():
                try:
                    cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    stat = (proc / "stat").read_text()
                except OSError:
                    continue
                if str(self.root) in cmdline and stat.rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(proc.name))
        return pids

    def leftovers(self) -> list[str]:
        """What of this cluster still exists: namespaces, links, processes naming its folder."""
        left = [f"netns {n}" for n in _run("ip", "netns", "list", check=False).stdout.split()
                if n.startswith(f"msj{self.tag}")]
        links = _run("ip", "-o", "link", "show", check=False).stdout
        left += [f"link {name}" for name in (self.bridge, *(f"{self.netns(n)}h" for n in self.nodes))
                 if f" {name}:" in links or f" {name}@" in links]
        left += [f"process {pid}" for pid in self._daemons()]
        return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/msjax-slurm")
    args = parser.parse_args(argv)
    if missing_tools():
        print(f"error: missing {', '.join(missing_tools())} (apt-get install slurmctld slurmd slurm-client munge)",
              file=sys.stderr)
        return 2
    cluster = SlurmCluster(Path(args.dir), nodes=args.nodes)
    if args.action == "up":
        cluster.up()
        # the daemons outlive this command: they are in sessions of their own
        print(f"export SLURM_CONF={cluster.conf}")
        return 0
    left = cluster.down()
    print("\n".join(left) or "nothing left")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
