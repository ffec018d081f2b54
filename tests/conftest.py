"""Eight fake CPU devices for every test, so parallel layouts run in one process (set before jax is imported).

The eight fake devices are threads sharing the machine's cores. XLA:CPU aborts the whole process when a
collective's participants do not all reach its rendezvous within a termination timeout (40 s by default;
measured here: a data x sequence x tensor step aborted that way while other jobs loaded the 2 cores). The tests
raise that timeout to 300 s. It is still a timeout, and XLA's message still names the collective it waited for.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_collective_call_terminate_timeout_seconds=300"
                           " --xla_cpu_collective_timeout_seconds=300").strip()
