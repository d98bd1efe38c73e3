"""What NOAH's one-shot search costs next to training its subnet, on mini/digits with the default backbone.

    OMP_NUM_THREADS=2 python benchmarks/noah_search_cost.py [rounds]
    OMP_NUM_THREADS=2 python benchmarks/noah_search_cost.py search EPOCHS GENERATIONS POPULATION


Times, in one process: one supernet epoch (a random subnet per step, :func:`petl.methods.noah_search.
train_supernet`) on the four fifths of train800 the search trains on, scoring one candidate subnet on the held-out
fifth, and one ordinary training epoch of a NOAH subnet on all of train800 (AdamW, the same batch size).  The
cost of a search at a given budget is then ``epochs x supernet epoch + scored candidates x scoring``; NOAH's own
budget is 500 supernet epochs and 15 generations of 50 candidates (up to 800 scored).  The result is a ratio to
a training epoch, so a loaded machine shifts it less than the seconds; the load average is printed beside it.

``search`` runs the whole one-shot search once, as ``petl-run``'s calibrate hook does (the same split, supernet
training and evolution, seed 0), at the budget given, and prints each phase's wall and CPU seconds, the subnets
scored, the chosen subnet and the cost of NOAH's own budget extrapolated from the per-epoch and per-subnet CPU
seconds measured (results: benchmarks/results/noah_search_cpu.md).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader

import petl
from petl.methods import noah_search
from petl.methods.noah import NoahConfig, subnet_params
from petl.run import default_config
from petl.train import build

BATCH = 64


def one_search(epochs: int, generations: int, population: int) -> None:
    """Run NOAH's search once on mini/digits at this budget; print its phases' cost and the subnet chosen."""
    cfg = default_config(["data=mini/digits", "method=noah", f"train.batch_size={BATCH}", "train.progress=false"])
    torch.manual_seed(0)
    backbone = build.create_backbone(cfg)
    loader = DataLoader(build.calibration_set(cfg, backbone), batch_size=BATCH)
    noah = NoahConfig(num_classes=10, search_epochs=epochs, search_generations=generations, population=population)
    print(f"load average at start {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    rng, device, depth, width = (
        random.Random(0),
        torch.device("cpu"),
        petl.backbone_of(backbone).depth(),
        noah.supernet_dim,
    )
    clock = [(time.perf_counter(), time.process_time())]
    supernet = petl.apply(
        backbone, "noah", num_classes=10, prompt=[width] * depth, lora=[width] * depth, adapter=[width] * depth
    )
    train, held_out = noah_search._split(loader)
    noah_search.train_supernet(supernet, train, epochs, rng, device)
    clock.append((time.perf_counter(), time.process_time()))
    best, accuracy, scored = noah_search.evolve(supernet, held_out, noah, rng, device)
    clock.append((time.perf_counter(), time.process_time()))
    (wall_0, cpu_0), (wall_1, cpu_1), (wall_2, cpu_2) = clock
    print(f"load average at end {' '.join(f'{x:.1f}' for x in os.getloadavg())}; threads {torch.get_num_threads()}")
    print(
        f"supernet: {epochs} epochs on {sum(len(y) for _, y in train)} images: {wall_1 - wall_0:.0f} s wall, "
        f"{cpu_1 - cpu_0:.0f} s CPU"
    )
    print(
        f"evolution: {generations} generations, population {population}: {scored} subnets scored on "
        f"{sum(len(y) for _, y in held_out)} images: {wall_2 - wall_1:.0f} s wall, {cpu_2 - cpu_1:.0f} s CPU"
    )
    print(
        f"chosen subnet (held-out top-1 {accuracy:.2f}), {subnet_params(petl.backbone_of(backbone).width(), *best)} "
        "trainable parameters without the head:"
    )
    for name, widths in zip(noah_search.MODULES, best, strict=True):
        print(f"  {name}: {','.join(map(str, widths))}")
    per_epoch, per_subnet = (cpu_1 - cpu_0) / epochs, (cpu_2 - cpu_1) / scored
    full = 500 * per_epoch + 800 * per_subnet
    print(
        f"extrapolated to NOAH's budget (500 epochs, up to 800 scored): {full / 3600:.1f} CPU hours "
        f"({500 * per_epoch / 3600:.1f} supernet + {800 * per_subnet / 3600:.1f} evolution)"
    )


def main(argv: list[str]) -> None:
    """Print seconds per supernet epoch, per scored candidate and per training epoch, and the search's cost."""
    if argv[:1] == ["search"]:
        one_search(*(int(a) for a in argv[1:4]))
        return
    rounds = int(argv[0]) if argv and argv[0].isdigit() else 2
    cfg = default_config(["data=mini/digits", "method=noah", f"train.batch_size={BATCH}", "train.progress=false"])
    torch.manual_seed(0)
    backbone = build.create_backbone(cfg)
    dataset = build.calibration_set(cfg, backbone)  # train800, centre-cropped: what the calibrate hook gets
    loader = DataLoader(dataset, batch_size=BATCH)
    noah = NoahConfig(num_classes=10)
    train, held_out = noah_search._split(loader)
    width, depth = noah.supernet_dim, petl.backbone_of(backbone).depth()
    supernet = petl.apply(
        backbone, "noah", num_classes=10, prompt=[width] * depth, lora=[width] * depth, adapter=[width] * depth
    )
    subnet = petl.apply(build.create_backbone(cfg), "noah", num_classes=10)  # the placeholder subnet
    optimizer = torch.optim.AdamW([p for p in subnet.parameters() if p.requires_grad], lr=1e-3)
    everything = train + held_out
    rng = random.Random(0)
    super_s, score_s, epoch_s = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        noah_search.train_supernet(supernet, train, 1, rng, torch.device("cpu"))
        super_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        noah_search.set_subnet(supernet, noah_search.random_subnet(depth, rng))
        noah_search._accuracy(supernet, held_out, torch.device("cpu"))
        score_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        subnet.train()
        for images, labels in everything:
            loss = torch.nn.functional.cross_entropy(subnet(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        epoch_s.append(time.perf_counter() - start)
    sup, score, epoch = (statistics.median(v) for v in (super_s, score_s, epoch_s))
    images = sum(len(y) for _, y in train), sum(len(y) for _, y in held_out)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; threads {torch.get_num_threads()}")
    print(f"supernet epoch ({images[0]} images): {sup:.1f} s; scoring one subnet ({images[1]} images): {score:.2f} s")
    print(f"training epoch of the subnet ({sum(images)} images): {epoch:.1f} s")
    for label, epochs, scored in (("NOAH's budget", 500, 800), ("500 epochs, 50 scored", 500, 50)):
        cost = epochs * sup + scored * score
        print(f"{label}: {cost / epoch:.0f} training epochs ({cost / (100 * epoch):.1f}x a 100-epoch training)")


if __name__ == "__main__":
    main(sys.argv[1:])
