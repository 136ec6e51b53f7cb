"""A GPT-style character-level language model (Flax NNX), data-parallel with fdp.

A decoder-only transformer (learned positions, pre-LayerNorm blocks of causal
self-attention and an MLP, dropout) trained on the docstrings of Python's standard
library, which every Python install has: the corpus is built from the source files
(parsed with ``ast``, nothing imported), the same on every machine with the same
Python version. AdamW with linear warm-up and cosine decay, global-norm clipping,
gradient accumulation, a ZeRO stage flag, periodic checkpoints and resume,
evaluation on held-out text, and sampling. docs/gpt.md walks through it.

    python examples/gpt.py                              # ~1.8M parameters, 600 steps
    python examples/gpt.py --zero-stage 3 --ckpt-dir /tmp/gpt   # run again: it resumes
    fdp launch --nproc-per-node 2 examples/gpt.py --steps 200

Without a GPU it simulates 8 CPU devices (under ``fdp launch``, 8 / N per process).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import sysconfig
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import fdp

# Modules whose docstrings make the corpus (pure-Python files of the standard library).
MODULES = (
    "argparse", "ast", "asyncio.tasks", "base64", "bisect", "calendar", "collections",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "enum", "fractions", "ftplib", "functools", "gettext", "glob", "gzip", "heapq", "hmac",
    "http.client", "imaplib", "inspect", "ipaddress", "json.decoder", "json.encoder",
    "locale", "logging", "mailbox", "multiprocessing.pool", "ntpath", "numbers", "operator",
    "optparse", "os", "pathlib", "pickle", "pprint", "pydoc", "queue", "random", "re",
    "shlex", "shutil", "smtplib", "socket", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback", "typing",
    "unittest.case", "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip
# The alphabet: printable ASCII and newline; anything else is dropped.
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


@functools.cache
def corpus() -> str:
    """The docstrings of ``MODULES``, in a fixed order (a few hundred thousand characters)."""
    stdlib = pathlib.Path(sysconfig.get_path("stdlib"))
    docs = []
    for name in MODULES:
        path = stdlib.joinpath(*name.split(".")).with_suffix(".py")
        if not path.is_file():  # a package: its __init__.py
            path = stdlib.joinpath(*name.split("."), "__init__.py")
        if not path.is_file():
            continue  # a module this Python build does not ship as source
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append(doc.strip() + "\n\n")
    text = "".join(docs)
    return "".join(c for c in text if c in CHARS)


def encode(text: str) -> np.ndarray:
    index = {c: i for i, c in enumerate(CHARS)}
    return np.array([index[c] for c in text if c in index], np.int32)


def decode(tokens: Any) -> str:
    return "".join(CHARS[int(t)] for t in tokens)


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = len(CHARS)
    block: int = 128  # context length
    d_model: int = 192
    heads: int = 6
    layers: int = 4
    dropout: float = 0.1
    dtype: Any = jnp.float32  # compute dtype; parameters stay float32


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        d, dt = cfg.d_model, cfg.dtype
        self.heads = cfg.heads
        self.ln1 = nnx.LayerNorm(d, dtype=dt, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, dtype=dt, rngs=rngs)
        self.proj = nnx.Linear(d, d, dtype=dt, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, dtype=dt, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, dtype=dt, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, dtype=dt, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        # Softmax in float32 whatever the compute dtype.
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9).astype(jnp.float32), -1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v).reshape(b, t, d)
        x = x + self.dropout(self.proj(attn))
        return x + self.dropout(self.down(nnx.gelu(self.up(self.ln2(x)))))


class GPT(nnx.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm and a head."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(cfg.vocab, cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.positions = nnx.Embed(cfg.block, cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln = nnx.LayerNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)).astype(jnp.float32)  # logits in float32


def loss_fn(model: GPT, batch: dict) -> jax.Array:
    """Mean next-character cross-entropy over the batch's tokens."""
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def optimizer_for(model: GPT, args: argparse.Namespace) -> nnx.Optimizer:
    """AdamW with warm-up and cosine decay, clipped to global norm 1; no decay on 1-D leaves."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1), end_value=args.lr / 10
    )
    decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay),
    )
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def batch_at(tokens: np.ndarray, step: int, batch_size: int, block: int, seed: int) -> dict:
    """The global batch of ``step``: random windows, the same for any number of processes."""
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(tokens) - block - 1, size=batch_size)
    windows = np.stack([tokens[s : s + block + 1] for s in starts])
    return {"x": windows[:, :-1], "y": windows[:, 1:]}


def local_rows(batch: dict) -> dict:
    """This process's share of a global batch (``fdp.shard_batch`` joins them in order)."""
    n, i = fdp.process_count(), fdp.process_index()
    rows = len(batch["x"]) // n
    return {k: v[i * rows : (i + 1) * rows] for k, v in batch.items()}


@jax.jit
def eval_loss(graphdef: Any, state: Any, batch: dict) -> jax.Array:
    """The mean loss on ``batch``: a pure function of the model's state.

    Nothing is written back into the model, so a ZeRO-3 model keeps its sharded
    parameters (an ``@fdp.ddp`` step that takes the model would return them
    replicated); jit gathers what the forward pass needs inside the call.
    """
    return loss_fn(nnx.merge(graphdef, state), batch)


def host_params(model: GPT) -> Any:
    """The parameters, whole, as numpy arrays on every process (sharded or not)."""
    params = nnx.state(model, nnx.Param)
    if fdp.process_count() > 1:
        return multihost_utils.process_allgather(params, tiled=True)
    return jax.device_get(params)


def generate(cfg: Config, params: Any, prompt: str, length: int, seed: int) -> str:
    """Samples ``length`` characters after ``prompt`` on one device, temperature 0.8."""
    model = GPT(dataclasses.replace(cfg, dropout=0.0), nnx.Rngs(0))
    nnx.update(model, params)
    model.eval()

    @nnx.jit
    def next_token(model: GPT, window: jax.Array, key: jax.Array) -> jax.Array:
        logits = model(window[None])[0, -1]
        return jax.random.categorical(key, logits / 0.8)

    tokens = list(encode(prompt)) or [0]
    key = jax.random.key(seed)
    for _ in range(length):
        window = ([0] * cfg.block + tokens)[-cfg.block :]  # left-padded with newlines
        key, sub = jax.random.split(key)
        tokens.append(int(next_token(model, jnp.array(window, jnp.int32), sub)))
    return decode(tokens)


def config_from(args: argparse.Namespace) -> Config:
    return Config(
        block=args.block,
        d_model=args.d_model,
        heads=args.heads,
        layers=args.layers,
        dropout=args.dropout,
        dtype=jnp.bfloat16 if args.bf16 else jnp.float32,
    )


def split_corpus() -> tuple[np.ndarray, np.ndarray]:
    """The corpus as tokens: the first 90% to train on, the rest held out."""
    tokens = encode(corpus())
    split = int(0.9 * len(tokens))
    return tokens[:split], tokens[split:]


def held_out_batches(held_out: np.ndarray, args: argparse.Namespace) -> list[dict]:
    """The evaluation batches (global), fixed for the whole run."""
    return [
        batch_at(held_out, i, args.batch_size, args.block, seed=10**6)
        for i in range(args.eval_batches)
    ]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A character-level GPT, data-parallel with fdp.")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (sequences)")
    parser.add_argument("--accumulate-steps", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--block", type=int, default=128, help="context length")
    parser.add_argument("--d-model", type=int, default=192)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 params")
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint here and resume from it")
    parser.add_argument("--ckpt-every", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--sample", type=int, default=200, help="characters to generate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the losses and figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains (or resumes), evaluates and samples; returns the losses and figures."""
    args = parse(argv)
    lead = fdp.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    cfg = config_from(args)
    train, held_out = split_corpus()

    model = GPT(cfg, nnx.Rngs(params=args.seed, dropout=args.seed + 1))
    optimizer = optimizer_for(model, args)
    step = fdp.nnx_train_step(
        loss_fn,
        accumulation=fdp.Accumulation(steps=args.accumulate_steps),
        sharding=fdp.Sharding(zero_stage=args.zero_stage),
    )
    # Placed on the mesh now (sharded at ZeRO stages 1-3): the template to restore into.
    # The step donates the model's arrays: keep no reference to them across a step.
    step.init(model, optimizer)
    n_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    say(
        f"{len(jax.devices())} devices, {fdp.process_count()} process(es); "
        f"{n_params:,} parameters; {len(train):,} training characters; "
        f"zero_stage={args.zero_stage}"
    )

    start = 0
    ckpt = fdp.CheckpointManager(args.ckpt_dir, max_to_keep=2) if args.ckpt_dir else None
    if ckpt is not None and ckpt.latest_step() is not None:
        restored = ckpt.restore((model, optimizer))  # restores the objects in place
        start = restored.data_position["step"]
        say(f"resumed from step {start}")

    eval_batches = [fdp.shard_batch(local_rows(b)) for b in held_out_batches(held_out, args)]

    def evaluate() -> float:
        # busy(): under fdp launch, a long evaluation is a pause, never taken for a hang.
        with fdp.runtime.busy():
            model.eval()  # no dropout (a flag in the graphdef, so compiled once per mode)
            losses = [eval_loss(nnx.graphdef(model), nnx.state(model), b) for b in eval_batches]
            model.train()
            return float(np.mean([float(x) for x in losses]))

    losses: list[float] = []
    timed_steps, elapsed = 0, 0.0
    model.train()
    for i in range(start, args.steps):
        batch = batch_at(train, i, args.batch_size, cfg.block, args.seed)
        tic = time.perf_counter()
        metrics = step(model, optimizer, fdp.shard_batch(local_rows(batch)))
        losses.append(float(metrics["loss"]))  # waits for the step
        if i > start:  # the first step compiles
            elapsed += time.perf_counter() - tic
            timed_steps += 1
        done = i + 1
        if ckpt is not None and done % args.ckpt_every == 0:
            ckpt.save(done, (model, optimizer), data_position={"step": done})
        if done % args.eval_every == 0 or done == args.steps:
            tok_s = timed_steps * args.batch_size * cfg.block / elapsed if elapsed else 0.0
            say(
                f"step {done}: train loss {losses[-1]:.4f}, held-out loss {evaluate():.4f}, "
                f"{tok_s:,.0f} tokens/s"
            )
    if ckpt is not None:
        if args.steps > start and ckpt.latest_step() != args.steps:
            ckpt.save(args.steps, (model, optimizer), data_position={"step": args.steps})
        ckpt.close()

    tokens_per_s = timed_steps * args.batch_size * cfg.block / elapsed if elapsed else 0.0
    result: dict[str, Any] = {
        "losses": losses,
        "eval_loss": evaluate(),
        "tokens_per_s": tokens_per_s,
        "params": n_params,
    }
    params = host_params(model)
    if args.sample:
        text = generate(cfg, params, "The ", args.sample, args.seed)
        result["sample"] = text
        say(f"sample:\n{text}")
    if args.json and lead:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    # Simulated CPU devices, before JAX starts (GPUs are used as they are); under
    # `fdp launch` the LOCAL_WORLD_SIZE processes of this host share 8.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    jax.config.update("jax_num_cpu_devices", max(1, 8 // local))
    fdp.init()  # joins the other processes under `fdp launch`; alone, joins none
    main()
    sys.exit(0)
