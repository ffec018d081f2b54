"""Eight fake CPU devices for every test, so parallel layouts run in one process (set before jax is imported)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
