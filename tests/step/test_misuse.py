"""Mistakes in calling a step: a donated state passed again, a batch without rows."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _procs import run
from flax.training.train_state import TrainState

import fdp

REUSE = """
import jax
jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp, optax
from flax.training.train_state import TrainState
import fdp

def loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"]) ** 2)

step = fdp.train_step(loss)
s = fdp.replicate(TrainState.create(apply_fn=None, params={"w": jnp.ones((3, 2))},
                                    tx=optax.sgd(0.1)))
b = fdp.shard_batch({"x": jnp.ones((8, 3))})
new, _ = step(s, b)
try:
    step(s, b)
except RuntimeError as e:
    print("refused:", e)
new, metrics = step(new, b)  # the returned state still works
print("loss", float(metrics["loss"]))
"""


def test_a_donated_state_passed_again_is_refused_before_the_call(marker):
    """On today's main the second call kills the process with SIGSEGV (exit -11)."""
    out = run(["-c", REUSE], marker, timeout=120)
    assert out.returncode == 0, out.output[-3000:]
    assert (
        "refused: fdp.train_step: this state was donated to an earlier step and its arrays "
        "are deleted (state.step, and 1 more); use the state the step returned" in out.stdout
    )
    assert "loss " in out.stdout


def test_a_batch_without_rows_is_refused():
    def loss(params, batch):
        return jnp.mean(batch["x"] @ params["w"])

    state = fdp.replicate(
        TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))
    )
    with pytest.raises(ValueError, match=r"batch has no rows: leaf \['x'\] has shape \(0, 3\)"):
        fdp.train_step(loss)(state, {"x": np.zeros((0, 3), np.float32)})
