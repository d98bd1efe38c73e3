"""The host's work in a mixed batch on a GPU, measured on a CPU: ViT-B's ops with little arithmetic.

On a GPU, petl.MultiTask's eager forward of the 8-method set is bound by the host launching its ops (the GPU is
busy for half the call: benchmarks/results/multitask_cuda_profile.md).  This builds the same call as
benchmarks/multitask_speed.py does, on ViT-B's structure at a small token width and image size, on the GPU's path
(``launch_bound=True``), one thread, and prints the median time of one call of the MultiTask and of the plain
backbone once, the ops that compute (petl.utils.ops.CountOps) and the aten calls, nested ones included
(torch.profiler).  What is left of the call's time is mostly the host's: Python, dispatch and small kernels.

    python benchmarks/host_proxy.py                       # this checkout
    PETL_TREE=/tmp/old python benchmarks/host_proxy.py    # another checkout (git worktree add /tmp/old REV)

PETL_TREE's petl and benchmarks/multitask_speed.py are the ones measured (its build_cases, with a width given to
timm.create_model), so that an older tree is measured with its own code.  Numbers on a shared machine are noisy:
run two trees in turns, a few times each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

TREE = Path(os.environ.get("PETL_TREE", Path(__file__).resolve().parents[1]))
sys.path[:0] = [str(TREE), str(TREE / "benchmarks")]

import timm  # noqa: E402
import torch  # noqa: E402


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="8 methods", help="a task set of multitask_speed.py (TASK_SETS)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=64, help="token width (a head per 16 channels)")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import multitask_speed

    from petl.utils.ops import CountOps

    create = timm.create_model
    narrow = {"embed_dim": args.width, "num_heads": max(1, args.width // 16)}
    multitask_speed.timm.create_model = lambda *a, **k: create(*a, **narrow, **k)
    methods = multitask_speed.TASK_SETS[args.set]
    cases = multitask_speed.build_cases(
        "vit_base_patch16_224", methods, args.batch, img_size=args.img_size, launch_bound=True
    )
    calls = {"MultiTask": cases["MultiTask (mixed batch)"], "backbone once": cases["backbone once"]}
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for call in calls.values():
            call(), call()
        for _ in range(args.rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        with CountOps() as count:
            calls["MultiTask"]()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            calls["MultiTask"]()
    nested = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(
        f"{TREE}: {args.set}, batch {args.batch}, {args.img_size} px, width {args.width}: "
        f"MultiTask {ms['MultiTask']:.2f} ms, backbone once {ms['backbone once']:.2f} ms; "
        f"{sum(count.ops.values())} ops, {nested} aten calls (nested)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
