"""Simulated devices for tests and doctests: set before any JAX backend starts."""

import importlib.util
import os

# fdp's grain support is optional (the `grain` extra): without grain its doctests cannot run.
collect_ignore = [] if importlib.util.find_spec("grain") else ["fdp/data/_grain.py"]

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
