"""The same three models for JAX and PyTorch, built from the same numpy weights.

- ``mlp``: 8 hidden layers of 1024 with ReLU and a 10-way classifier (8.4M
  parameters), cross-entropy, plain SGD.
- ``transformer``: a pre-LayerNorm causal transformer (4 layers, width 256, 4 heads,
  sequence 64, vocabulary 2048; 4.2M parameters), next-token cross-entropy, plain SGD.
- ``cnn``: five 3x3 convolutions (32, 64, 128, 256, 256 channels; strides 1, 2, 2,
  1, 2) with ReLU on 32x32x3 images, global average pooling and a 10-way classifier
  (0.98M parameters, most of them in the convolutions), cross-entropy, plain SGD.

Both frameworks compute the same functions (tanh GELU, LayerNorm eps 1e-5), so the
benchmark compares how they run the same arithmetic, not different models.
"""

from __future__ import annotations

import itertools

import numpy as np

MLP_WIDTH, MLP_DEPTH, MLP_CLASSES = 1024, 8, 10
TF = {"vocab": 2048, "dim": 256, "heads": 4, "layers": 4, "seq": 64}
# (output channels, stride) of each 3x3 convolution; padding 1 on every side.
CNN_CONVS = ((32, 1), (64, 2), (128, 2), (256, 1), (256, 2))
CNN_IMAGE, CNN_CLASSES = 32, 10
LR = 0.01


def _dense(rng: np.random.Generator, n_in: int, n_out: int) -> dict[str, np.ndarray]:
    bound = 1.0 / np.sqrt(n_in)
    return {
        "w": rng.uniform(-bound, bound, size=(n_in, n_out)).astype(np.float32),
        "b": np.zeros(n_out, np.float32),
    }


def _conv(rng: np.random.Generator, n_in: int, n_out: int) -> dict[str, np.ndarray]:
    bound = 1.0 / np.sqrt(9 * n_in)
    return {
        "w": rng.uniform(-bound, bound, size=(3, 3, n_in, n_out)).astype(np.float32),
        "b": np.zeros(n_out, np.float32),
    }


def init_params(model: str, seed: int = 0) -> dict:
    """Initial weights as nested dicts of numpy arrays (dense ``w`` is ``[in, out]``,
    convolution ``w`` is ``[3, 3, in, out]``)."""
    rng = np.random.default_rng(seed)
    if model == "mlp":
        layers = [_dense(rng, MLP_WIDTH, MLP_WIDTH) for _ in range(MLP_DEPTH)]
        return {"layers": layers, "out": _dense(rng, MLP_WIDTH, MLP_CLASSES)}
    if model == "cnn":
        channels = [3] + [c for c, _ in CNN_CONVS]
        return {
            "convs": [_conv(rng, a, b) for a, b in itertools.pairwise(channels)],
            "out": _dense(rng, CNN_CONVS[-1][0], CNN_CLASSES),
        }
    d = TF["dim"]
    blocks = []
    for _ in range(TF["layers"]):
        blocks.append(
            {
                "ln1": {"g": np.ones(d, np.float32), "b": np.zeros(d, np.float32)},
                "q": _dense(rng, d, d),
                "k": _dense(rng, d, d),
                "v": _dense(rng, d, d),
                "o": _dense(rng, d, d),
                "ln2": {"g": np.ones(d, np.float32), "b": np.zeros(d, np.float32)},
                "fc1": _dense(rng, d, 4 * d),
                "fc2": _dense(rng, 4 * d, d),
            }
        )
    return {
        "tok": (rng.normal(size=(TF["vocab"], d)) * 0.02).astype(np.float32),
        "pos": (rng.normal(size=(TF["seq"], d)) * 0.02).astype(np.float32),
        "blocks": blocks,
        "ln": {"g": np.ones(d, np.float32), "b": np.zeros(d, np.float32)},
        "head": _dense(rng, d, TF["vocab"]),
    }


def make_batches(model: str, batch: int, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    """``count`` batches of ``batch`` examples (``x`` inputs, ``y`` integer labels)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        if model == "mlp":
            out.append(
                {
                    "x": rng.normal(size=(batch, MLP_WIDTH)).astype(np.float32),
                    "y": rng.integers(0, MLP_CLASSES, size=batch).astype(np.int32),
                }
            )
        elif model == "cnn":  # NHWC images
            out.append(
                {
                    "x": rng.normal(size=(batch, CNN_IMAGE, CNN_IMAGE, 3)).astype(np.float32),
                    "y": rng.integers(0, CNN_CLASSES, size=batch).astype(np.int32),
                }
            )
        else:
            tok = rng.integers(0, TF["vocab"], size=(batch, TF["seq"] + 1)).astype(np.int32)
            out.append({"x": tok[:, :-1], "y": tok[:, 1:]})
    return out


def param_count(params: dict) -> int:
    import jax

    return sum(int(np.prod(np.shape(p))) for p in jax.tree.leaves(params))


# ---------------------------------------------------------------- JAX ----------------


def jax_loss(model: str):
    import jax
    import jax.numpy as jnp
    import optax

    def layer_norm(p, x):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]

    def dense(p, x):
        return x @ p["w"] + p["b"]

    def mlp(params, x):
        for layer in params["layers"]:
            x = jax.nn.relu(dense(layer, x))
        return dense(params["out"], x)

    def transformer(params, tokens):
        b, s = tokens.shape
        h, d = TF["heads"], TF["dim"]
        x = params["tok"][tokens] + params["pos"][:s]
        mask = jnp.tril(jnp.ones((s, s), bool))
        for blk in params["blocks"]:
            y = layer_norm(blk["ln1"], x)
            q, k, v = (dense(blk[n], y).reshape(b, s, h, d // h) for n in "qkv")
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // h)
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
            y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
            x = x + dense(blk["o"], y)
            y = layer_norm(blk["ln2"], x)
            x = x + dense(blk["fc2"], jax.nn.gelu(dense(blk["fc1"], y), approximate=True))
        return dense(params["head"], layer_norm(params["ln"], x))

    def cnn(params, x):
        for p, (_, stride) in zip(params["convs"], CNN_CONVS, strict=True):
            x = jax.lax.conv_general_dilated(
                x,
                p["w"],
                (stride, stride),
                ((1, 1), (1, 1)),
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
            )
            x = jax.nn.relu(x + p["b"])
        return dense(params["out"], x.mean(axis=(1, 2)))

    forward = {"mlp": mlp, "cnn": cnn, "transformer": transformer}[model]

    def loss_fn(params, batch):
        logits = forward(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss_fn


# -------------------------------------------------------------- PyTorch --------------


def torch_module(model: str, params: dict):
    import math

    import torch
    from torch import nn

    def linear(p):
        layer = nn.Linear(*p["w"].shape)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(p["w"].T.copy()))
            layer.bias.copy_(torch.from_numpy(p["b"]))
        return layer

    def norm(p):
        layer = nn.LayerNorm(p["g"].shape[0], eps=1e-5)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(p["g"]))
            layer.bias.copy_(torch.from_numpy(p["b"]))
        return layer

    if model == "mlp":

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(linear(p) for p in params["layers"])
                self.out = linear(params["out"])

            def forward(self, x):
                for layer in self.layers:
                    x = torch.relu(layer(x))
                return self.out(x)

        return MLP()

    if model == "cnn":

        def conv(p, stride):
            layer = nn.Conv2d(p["w"].shape[2], p["w"].shape[3], 3, stride=stride, padding=1)
            with torch.no_grad():  # [3, 3, in, out] -> [out, in, 3, 3]
                layer.weight.copy_(torch.from_numpy(p["w"].transpose(3, 2, 0, 1).copy()))
                layer.bias.copy_(torch.from_numpy(p["b"]))
            return layer

        class CNN(nn.Module):
            def __init__(self):
                super().__init__()
                self.convs = nn.ModuleList(
                    conv(p, s) for p, (_, s) in zip(params["convs"], CNN_CONVS, strict=True)
                )
                self.out = linear(params["out"])

            def forward(self, x):  # NHWC in, as for JAX
                x = x.permute(0, 3, 1, 2)
                for layer in self.convs:
                    x = torch.relu(layer(x))
                return self.out(x.mean(dim=(2, 3)))

        return CNN()

    class Block(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.ln1, self.ln2 = norm(p["ln1"]), norm(p["ln2"])
            self.q, self.k, self.v, self.o = (linear(p[n]) for n in "qkvo")
            self.fc1, self.fc2 = linear(p["fc1"]), linear(p["fc2"])

        def forward(self, x, mask):
            b, s, d = x.shape
            h = TF["heads"]
            y = self.ln1(x)
            q, k, v = (f(y).view(b, s, h, d // h) for f in (self.q, self.k, self.v))
            att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
            att = torch.softmax(att.masked_fill(~mask, -1e9), dim=-1)
            y = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
            x = x + self.o(y)
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Parameter(torch.from_numpy(params["tok"].copy()))
            self.pos = nn.Parameter(torch.from_numpy(params["pos"].copy()))
            self.blocks = nn.ModuleList(Block(p) for p in params["blocks"])
            self.ln, self.head = norm(params["ln"]), linear(params["head"])
            self.register_buffer("mask", torch.tril(torch.ones(TF["seq"], TF["seq"], dtype=bool)))

        def forward(self, tokens):
            s = tokens.shape[1]
            x = self.tok[tokens] + self.pos[:s]
            for blk in self.blocks:
                x = blk(x, self.mask[:s, :s])
            return self.head(self.ln(x))

    return Transformer()


def cpu_seconds() -> tuple[float, float]:
    """User and system CPU seconds of this process so far (all its threads)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def minor_faults() -> int:
    """Minor page faults of this process so far (each a 4 KiB page touched afresh)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def memory_mib() -> dict[str, float]:
    """This process's resident set now and at its peak (``/proc/self/status``), in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[{"VmRSS": "rss_mib", "VmHWM": "peak_rss_mib"}[key]] = (
                    int(value.split()[0]) / 1024
                )
    return out


def result_record(framework: str, args, nproc: int, params: dict, rounds: list, losses: list):
    """What a worker of ``multiprocess.py`` reports (rank 0 writes it as JSON)."""
    import os
    import statistics

    step_s = statistics.median(rounds)
    return {
        "framework": framework,
        "model": args.model,
        "nproc": nproc,
        "batch": args.batch,
        "params": param_count(params),
        "step_s": step_s,
        "round_step_s": rounds,
        "examples_per_s": args.batch * nproc / step_s,
        "first_losses": losses,
        "bucket_cap_mb": args.bucket_cap_mb,
        "affinity": sorted(os.sched_getaffinity(0)),
    }
