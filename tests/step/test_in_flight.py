"""The bound on queued steps that jax 0.10's XLA:CPU needs (fdp/step/core/_in_flight.py).

jaxlib 0.10.2 aborts a process whose multi-device CPU steps queue up unawaited
(``rendezvous.cc: Termination timeout for all reduce``): 3,000 plain-jit steps on 2
simulated devices did, 3 of 3 runs; jax 0.12 did not.
"""

import jax
import jax.numpy as jnp
import pytest
from _procs import WORKERS, run

import fdp
from fdp import _compat
from fdp.step.core._in_flight import InFlight
from fdp.step.core._runner import in_flight


def test_past_the_limit_the_oldest_call_is_waited_for():
    waited = []

    class Pending:  # a queued array: records when the host waits for it
        size = 1

        def __init__(self, i):
            self.i = i

        def is_deleted(self):
            return self.i == 1  # donated to a later call: nothing to wait for

        def block_until_ready(self):
            waited.append(self.i)

    queue = InFlight(3)
    queue.held.extend(Pending(i) for i in range(3))
    queue.add({"loss": jnp.float32(0.0), "params": jnp.ones(8)})
    queue.add({"loss": jnp.float32(1.0)})
    assert waited == [0]  # 1 was deleted; 2 is still within the limit
    assert len(queue.held) == 3 and queue.held[-1].size == 1  # the loss, not the params
    with pytest.raises(ValueError, match="limit must be a positive number of calls, got 0"):
        InFlight(0)


def test_the_cpu_backend_bounds_multi_device_meshes_only_under_jax_0_10():
    old = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)
    mesh = fdp.data_mesh()  # 8 CPU devices of this process
    one = fdp.data_mesh(jax.devices()[:1])
    assert (in_flight(mesh) is not None) is old
    assert in_flight(one) is None
    if old:
        assert in_flight(mesh).limit == _compat.CPU_STEPS_IN_FLIGHT


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fdp", "ddp"])
def test_thousands_of_steps_queued_on_two_cpu_devices_complete(kind, marker):
    out = run([str(WORKERS / "queued_steps.py"), "3000", kind], marker, timeout=240)
    assert out.returncode == 0, out.output[-2000:]
    assert f"{kind}: 3000 steps" in out.stdout
