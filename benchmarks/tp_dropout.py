"""The cost of drawing one process's dropout masks under tensor parallelism, against the shared stream and per-rank
streams, on one Hugging Face GPT-2 block at tp=2.

    python benchmarks/tp_dropout.py [--rounds 6] [--steps 3] [--batch 4]

A GPT-2 block (``attn_pdrop = resid_pdrop = 0.1``), swapped for tp=2 over 2 CPU processes (gloo, one intra-op
thread each) by transformers' layout translation, three ways (see [Note: random numbers under tensor parallelism]
in ``lightning_mp/tp/_random.py``):

- ``shared``: no region hooks (before issue 21): every tp rank draws the mask of its own heads from the same
  stream, so the shards' masks are copies of each other (not what one process draws);
- ``one_process`` (the default): the attention-weight mask is drawn for all heads and sliced (equal to tp=1);
- ``per_rank``: each rank draws its own heads' mask from a stream of its own (Megatron's tracker behaviour).

One step is forward + backward of the block on ``(B, T, C)`` (``loss = mean(y^2)``). Methods alternate round by
round (``--rounds`` x ``--steps`` timed steps after a warm-up round); the table gives rank 0's step time in its
fastest round (the least disturbed by other load on a shared machine) and the ratio to ``shared`` in the same
run, for eager and SDPA attention and two shapes (the mask has ``B nh T^2`` elements, the matmuls ``~ B T C^2``
work: long sequences at small width cost the most).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

METHODS = ("shared", "one_process", "per_rank")
SHAPES = ((256, 8, 256), (512, 8, 64))  # (C, nh, T)


def _blocks(width: int, heads: int, seq: int, attn: str, group: dist.ProcessGroup) -> dict:
    import transformers

    import lightning_mp
    from lightning_mp.tp import TPGroup
    from lightning_mp.nn._hf import translate_hf
    from lightning_mp.tp._random import install_sharded_random, remove_sharded_random
    from lightning_mp.tp._swap import swap_modules

    config = transformers.GPT2Config(
        vocab_size=64, n_embd=width, n_layer=1, n_head=heads, n_positions=seq, attn_pdrop=0.1, resid_pdrop=0.1,
        embd_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(config).train()
    tp = TPGroup.of(group)
    blocks = {}
    for method in METHODS:
        model = lightning_mp.set_tensor_parallelism(copy.deepcopy(base))
        swap_modules(model, tp, translations=[translate_hf])
        if method == "shared":
            assert remove_sharded_random(model), "the swap installed regions"
        elif method == "per_rank":
            install_sharded_random(model, tp, streams="per_rank")
        blocks[method] = model.transformer.h[0]
    return blocks


def _time(block, x: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        block(x)[0].pow(2).mean().backward()
    return (time.perf_counter() - start) / steps


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = []
    for width, heads, seq in SHAPES:
        for attn in ("eager", "sdpa"):
            blocks = _blocks(width, heads, seq, attn, dist.group.WORLD)
            x = torch.randn(args.batch, seq, width, generator=torch.Generator().manual_seed(1))
            times = {m: [] for m in METHODS}
            for round_ in range(args.rounds + 1):
                for method in METHODS:
                    elapsed = _time(blocks[method], x, args.steps)
                    if round_:  # the first round warms up
                        times[method].append(elapsed)
            rows.append((width, heads, seq, attn, {m: min(t) for m, t in times.items()}))
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.start_processes(_worker, args=(2, os.path.join(tmp, "rv"), args, out), nprocs=2, start_method="spawn")
        rows = torch.load(out)
    print(f"GPT-2 block at tp=2 (2 gloo processes, 1 thread each), B={args.batch}, dropout 0.1; step = fwd + bwd")
    print("| C | heads | T | attention | shared ms | one_process ms | per_rank ms | one_process / shared |"
          " per_rank / shared |")
    print("|---|---|---|---|---|---|---|---|---|")
    for width, heads, seq, attn, t in rows:
        print(
            f"| {width} | {heads} | {seq} | {attn} | {t['shared'] * 1e3:.1f} | {t['one_process'] * 1e3:.1f} |"
            f" {t['per_rank'] * 1e3:.1f} | {t['one_process'] / t['shared']:.3f} | {t['per_rank'] / t['shared']:.3f} |"
        )


if __name__ == "__main__":
    main()
