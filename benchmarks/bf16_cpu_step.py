"""Time one LoRA training step on the default mini backbone in fp32 and under bf16 autocast on the CPU.

The numbers in benchmarks/results/bf16_cpu.md come from this script:

    OMP_NUM_THREADS=1 python benchmarks/bf16_cpu_step.py [rounds] [--profile]

Batch 64 of 32 x 32 images through ``vit_fractal_tiny_patch4_32`` with LoRA (rank 8 on Q and V) and a
10-class head, AdamW step included; the two precisions alternate round by round because a shared
machine's load drifts.  ``torch.autocast("cpu", dtype=torch.bfloat16)`` is what accelerate wraps the
model's forward in for ``train.precision=bf16`` on a CPU (accelerate 1.15
``utils/modeling.py:get_mixed_precision_context_manager``).  ``--profile`` prints the ops that take the
time under bf16.
"""

from __future__ import annotations

import statistics
import sys
import time

import timm
import torch

import petl
import petl.backbones.models  # noqa: F401  (registers vit_fractal_tiny_patch4_32 with timm)

BATCH = 64


def main(argv: list[str]) -> None:
    """Print images/s per step for fp32 and bf16, interleaved, and their medians."""
    rounds = int(argv[0]) if argv and argv[0].isdigit() else 3
    torch.manual_seed(0)
    model = timm.create_model("vit_fractal_tiny_patch4_32", pretrained=False)  # weights do not change the speed
    petl.apply_lora(model, num_classes=10)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    images, labels = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))

    def step(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return BATCH / (time.perf_counter() - start)

    step(False), step(True)  # warm-up
    speeds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for bf16 in (False, True):
            speeds[bf16].append(step(bf16))
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    for bf16, values in speeds.items():
        shown = " ".join(f"{v:.1f}" for v in values)
        print(f"{'bf16' if bf16 else 'fp32'} img/s per step: {shown}  median {statistics.median(values):.1f}")
    if "--profile" in argv:
        from torch.profiler import profile

        with profile() as prof:
            step(True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))


if __name__ == "__main__":
    main(sys.argv[1:])
