"""Time a VPT training step on petl's FractalDB Swin with the prompts' attention computed two ways.

The numbers in benchmarks/results/vpt_swin_cpu.md come from this script:

    OMP_NUM_THREADS=1 python benchmarks/vpt_swin_step.py [--prompts 100] [--deep] [--rounds 10]

Batch 64 of 32 x 32 images through ``swin_fractal_tiny_patch2_window4_32`` (random weights: they do not change the
speed) with VPT and a 10-class head, forward, loss, backward and AdamW step, as the mini suite trains it.  Two ways
of the same numbers take turns round by round (a shared machine's load drifts):

* apart: what petl does, ``petl.model.backbone.swin_prompts._prompts_apart`` where the prompts outnumber a
  window's tokens, the prompts' attention among themselves once per image;
* every window: ``_prompts_in_every_window`` everywhere, the prompts' attention computed in every window as the
  reference's order has it (what petl did before).

With fewer prompts than a window's tokens (``--prompts 10``: VPT-deep's count) both run the same code, so their
ratio shows the noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import timm
import torch

import petl
import petl.backbones.models  # noqa: F401  (registers the FractalDB Swin with timm)
from petl.model.backbone import swin_prompts

BATCH = 64


def every_window(attn, windows, prompts, mask):
    """``_prompts_apart``'s signature and result through the per-window computation."""
    windows_out, prompts_out = swin_prompts._prompts_in_every_window(attn, windows, prompts, mask, 0.0)
    return windows_out, prompts_out.mean(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=100, help="prompt tokens (VPT-shallow: 100)")
    parser.add_argument("--deep", action="store_true", help="prompts of its own in every block")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps of each way, after one warm-up")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = timm.create_model("swin_fractal_tiny_patch2_window4_32", pretrained=False)
    petl.apply_vpt(model, num_tokens=args.prompts, deep=args.deep, num_classes=10)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    images, labels = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))
    ways = {"apart": swin_prompts._prompts_apart, "every window": every_window}

    def step(way: str) -> float:
        swin_prompts._prompts_apart = ways[way]  # prompted_window_attention looks it up at every call
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    for way in ways:
        step(way)  # warm-up
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            times[way].append(step(way))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"VPT ({'deep' if args.deep else 'shallow'}, {args.prompts} prompts), batch {BATCH}, torch {torch.__version__}"
        f", {torch.get_num_threads()} thread(s), commit {commit or '?'}, 1-min load {os.getloadavg()[0]:.1f}"
    )
    medians = {way: statistics.median(values) for way, values in times.items()}
    for way, values in times.items():
        print(
            f"{way:>12}: median {medians[way] * 1000:.0f} ms a step (of {', '.join(f'{v * 1000:.0f}' for v in values)})"
        )
    print(f"apart / every window: {medians['apart'] / medians['every window']:.3f}")


if __name__ == "__main__":
    main()
