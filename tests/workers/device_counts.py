"""Two processes with different numbers of CPU devices (1 on rank 1, 2 on the others).

Run under `fdp launch --nproc-per-node 2`. Builds fdp's data mesh and one step, which
must fail on every process with an error that names each process's device count.
"""

import os

import jax

rank = int(os.environ["RANK"])
jax.config.update("jax_num_cpu_devices", 1 if rank == 1 else 2)

import numpy as np  # noqa: E402

import fdp  # noqa: E402

fdp.init(initialization_timeout=60)
mesh = fdp.data_mesh()
print(f"mesh {dict(mesh.shape)}", flush=True)
batch = fdp.shard_batch(np.zeros((4, 2), np.float32), mesh)
print(f"batch {batch.shape}", flush=True)
