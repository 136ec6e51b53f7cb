"""Where arrays lie on the mesh: ZeRO stages 1-3 over the data axis, HSDP, padding, sharded init."""
