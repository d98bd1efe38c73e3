"""NOAH's one-shot search: train a supernet of every module at full width, then evolve subnets on held-out data.

Follows ZhangYuanhan-AI/NOAH@e9c55f3:

* supernet training (supernet_train_prompt.py with ``--mode super``; supernet_engine_prompt.py L13-49 and
  L74-83): every step samples a subnet, per module a depth from the depth choices (its first ``depth`` blocks
  carry it) and a width per carrying block from the width choices, and trains the shared weights on that subnet;
  AdamW lr 5e-4, weight decay 1e-4, cosine schedule after a warm-up of 10 of its 500 epochs
  (configs/NOAH/VTAB/supernet/slurm_train_vtab.sh; supernet_train_prompt.py L74-108);
* evolution (evolution.py L29-329, defaults L336-345): a population of random subnets under the parameter limit,
  each scored by top-1 on held-out data; per generation the best 10 are kept, 25 mutations (per module with
  probability 0.2: with probability 0.4 a new depth, new widths for added blocks) and 25 crossovers (per module,
  the widths of one of two parents) are added and the population is refilled at random; the best subnet wins.
  NOAH trains the supernet on train800 and scores candidates on val200 (lib/datasets.py L21-31); petl's
  calibrate hook gets the run's training split in batches of the run's training batch size (NOAH's scripts use
  ``--batch-size=64`` for the supernet and the retraining alike); every fifth image of the split, counted across
  batches, is held out for scoring, so a supernet step trains on about four fifths of a batch.

The search runs on a copy of the backbone; the model it was given is left as it was.  It saves its progress
(the supernet, optimizer, schedule and random states after an epoch or a generation, at most once a minute) in
petl's cache folder under a key of everything it depends on, so a search killed part-way (a session ending in the
middle of NOAH's 500 epochs) resumes where it stopped and chooses what it would have chosen; the file is removed
when the search ends.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import math
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from petl.methods.noah import (
    DEPTH_FRACTIONS,
    SEARCH_WIDTHS,
    NoahConfig,
    noah_blocks,
    subnet_params,
    widths_text,
    wire,
)
from petl.model import surgery
from petl.model.backbone import backbone_of
from petl.model.registry import register_calibration
from petl.utils import paths
from petl.utils.progress import progress_bar
from petl.utils.text import plural

log = logging.getLogger(__name__)

MODULES = ("prompt", "lora", "adapter")
HELD_OUT_EVERY = 5  # every fifth image scores candidates: NOAH's 200 of 1,000
SELECT, MUTATIONS, CROSSOVERS = 10, 25, 25  # evolution.py L337-343
MUTATE_P, DEPTH_P = 0.2, 0.4
LR, WEIGHT_DECAY, WARMUP_FRACTION, MIN_LR = 5e-4, 1e-4, 10 / 500, 1e-5

SAVE_EVERY_SECONDS = 60.0  # a killed search loses at most about this much work (and the epoch under way)

Subnet = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class SearchCheckpoint:
    """A search's progress in a file, saved as it goes so that a killed search resumes; removed when it ends.

    Args:
        path: the file; ``None`` keeps nothing.

    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.state: dict[str, Any] = {}
        if path is not None and path.exists():
            try:
                self.state = torch.load(path, weights_only=True)
                missing = _missing(self.state)
                if missing:
                    raise ValueError(f"it lacks {', '.join(missing)}")
            except Exception as error:  # a file cut short or written by another version: search from the start
                log.warning("NOAH search: cannot read %s (%s); searching from the start", path, error)
                self.state = {}
        self._last_save = time.perf_counter()

    def due(self) -> bool:
        """Whether enough time has passed since the last save to save again."""
        return self.path is not None and time.perf_counter() - self._last_save >= SAVE_EVERY_SECONDS

    def save(self, **state: Any) -> None:
        """Add ``state`` to what is saved and write it atomically (a kill mid-write keeps the last file)."""
        if self.path is None:
            return
        self.state.update(state)

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:  # a file object: a full disk raises OSError, not torch's C++ error
                torch.save(self.state, f)

        try:
            paths.write_atomic(self.path, write)
        except OSError as error:  # a read-only or full cache folder: search on without saving
            log.warning(
                "NOAH search: cannot save its progress to %s (%s); a killed search starts over", self.path, error
            )
            self.path = None
        self._last_save = time.perf_counter()

    def finish(self) -> None:
        """The search ended: its progress is no longer needed."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


# What each stage's progress needs to go on (train_supernet's and evolve's saves).
_SAVED = {"epoch": ("supernet", "optimizer", "schedule", "rng", "torch_rng"), "steps": ("scores", "rng")}


def _missing(state: Any) -> list[str]:
    """The entries a saved progress lacks for the stage it says it reached (all of them if it is no mapping)."""
    if not isinstance(state, dict):
        return ["everything (not a mapping)"]
    return [key for stage, needed in _SAVED.items() if state.get(stage) for key in needed if key not in state]


def checkpoint_path(backbone: nn.Module, cfg: NoahConfig, seed: int, batches: list) -> Path:
    """Where a search saves its progress: keyed by the backbone, the config, the seed and the data.

    The backbone counts by its weights and by its modules as printed (``repr``): drop-path and dropout rates,
    norms and widths are no tensors, and a search with another ``model.drop_path`` trains another supernet.
    """
    digest = hashlib.sha256(repr((dataclasses.asdict(cfg), seed, repr(backbone))).encode())
    tensors = [*backbone.state_dict().values(), *(t for batch in batches for t in batch)]
    for tensor in tensors:
        digest.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return paths.cache_dir() / "noah_search" / f"{digest.hexdigest()[:32]}.pt"


def _random_states(device: torch.device) -> dict[str, torch.Tensor]:
    # The supernet's dropout draws from torch's generator (the subnets from the search's own ``rng``).
    states = {"torch_rng": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda_rng"] = torch.cuda.get_rng_state(device)
    return states


def _set_random_states(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], device)


def depth_choices(depth: int) -> tuple[int, ...]:
    """Carried-block counts: a quarter, half, three quarters and all blocks (NOAH's 3, 6, 9, 12 on ViT-B)."""
    return tuple(sorted({max(1, round(f * depth)) for f in DEPTH_FRACTIONS}))


def random_subnet(depth: int, rng: random.Random) -> Subnet:
    """One subnet as NOAH samples it: per module a depth, then a random width per carrying block."""
    out = []
    for _ in MODULES:
        carried = rng.choice(depth_choices(depth))
        out.append(tuple(rng.choice(SEARCH_WIDTHS) for _ in range(carried)) + (0,) * (depth - carried))
    return tuple(out)


def _carried(widths: tuple[int, ...]) -> int:
    return next((i for i, w in enumerate(widths) if w == 0), len(widths))


def mutate(subnet: Subnet, rng: random.Random) -> Subnet:
    """evolution.py L178-240: per module with probability 0.2, maybe a new depth; new blocks get random widths."""
    out = []
    for widths in subnet:
        if rng.random() < MUTATE_P:
            depth, current = len(widths), _carried(widths)
            new = rng.choice(depth_choices(depth)) if rng.random() < DEPTH_P else current
            if new > current:
                widths = widths[:current] + tuple(rng.choice(SEARCH_WIDTHS) for _ in range(new - current))
            else:
                widths = widths[:new]
            widths = widths + (0,) * (depth - len(widths))
        out.append(widths)
    return tuple(out)


def crossover(a: Subnet, b: Subnet, rng: random.Random) -> Subnet:
    """evolution.py L261-270: per module, the widths of one parent or the other."""
    return tuple(rng.choice([x, y]) for x, y in zip(a, b, strict=True))


def set_subnet(model: nn.Module, subnet: Subnet) -> None:
    """Make the supernet run ``subnet``: set every block's active widths, then the prompt wiring."""
    blocks = noah_blocks(model)
    for block, p, r, a in zip(blocks, *subnet, strict=True):
        block.prompt_len, block.adapter_dim = p, a
        block.family.linear(block.base, "qkv").rank = r
    wire(blocks)


def _split(loader: Iterable) -> tuple[list, list]:
    """Every fifth image of the split (counted across batches) is held out for scoring; the rest trains the supernet."""
    train, held_out, seen = [], [], 0
    for images, labels in loader:
        labels = torch.as_tensor(labels)
        keep = (seen + torch.arange(len(labels))) % HELD_OUT_EVERY != HELD_OUT_EVERY - 1
        seen += len(labels)
        if keep.any():
            train.append((images[keep], labels[keep]))
        if (~keep).any():
            held_out.append((images[~keep], labels[~keep]))
    if not held_out:
        raise ValueError(f"NOAH's search needs at least {HELD_OUT_EVERY} training images (a fifth is held out)")
    return train, held_out


@torch.no_grad()
def _accuracy(model: nn.Module, batches: list, device: torch.device) -> float:
    model.eval()
    correct = total = 0
    for images, labels in batches:
        labels = torch.as_tensor(labels).to(device)
        correct += (model(images.to(device)).argmax(-1) == labels).sum().item()
        total += len(labels)
    return 100.0 * correct / total


def train_supernet(
    model: nn.Module,
    batches: list,
    epochs: int,
    rng: random.Random,
    device: torch.device,
    progress: bool = True,
    checkpoint: SearchCheckpoint | None = None,
) -> None:
    """Train the supernet's shared weights, one random subnet per step (supernet_engine_prompt.py L74-126)."""
    checkpoint = checkpoint or SearchCheckpoint(None)
    named = {name: p for name, p in model.named_parameters() if p.requires_grad}
    params = list(named.values())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    steps = epochs * len(batches)
    warmup = max(1, round(WARMUP_FRACTION * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return MIN_LR / LR + (1 - MIN_LR / LR) * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    start = checkpoint.state.get("epoch", 0)
    if start:
        with torch.no_grad():
            for name, tensor in checkpoint.state["supernet"].items():
                named[name].copy_(tensor)
        optimizer.load_state_dict(checkpoint.state["optimizer"])
        schedule.load_state_dict(checkpoint.state["schedule"])
        rng.setstate(checkpoint.state["rng"])
        _set_random_states(checkpoint.state, device)
    depth = backbone_of(model).depth()
    model.train()
    bar = progress_bar(
        range(start, epochs),
        initial=start,
        total=epochs,
        desc="NOAH supernet",
        unit="epoch",
        leave=False,
        show=progress,
        say=log.info,
    )
    for epoch in bar:
        for images, labels in batches:
            set_subnet(model, random_subnet(depth, rng))
            loss = F.cross_entropy(model(images.to(device)), torch.as_tensor(labels).to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if checkpoint.due() or epoch + 1 == epochs:
            checkpoint.save(
                epoch=epoch + 1,
                supernet={name: p.detach().clone() for name, p in named.items()},
                optimizer=optimizer.state_dict(),
                schedule=schedule.state_dict(),
                rng=rng.getstate(),
                **_random_states(device),
            )


def evolve(
    model: nn.Module,
    held_out: list,
    cfg: NoahConfig,
    rng: random.Random,
    device: torch.device,
    progress: bool = True,
    checkpoint: SearchCheckpoint | None = None,
) -> tuple[Subnet, float, int]:
    """NOAH's evolutionary search (evolution.py L284-329); returns the best subnet, its accuracy, evaluations."""
    bb = backbone_of(model)
    checkpoint = checkpoint or SearchCheckpoint(None)
    depth, dim = bb.depth(), bb.width()
    scores: dict[Subnet, float] = dict(checkpoint.state.get("scores", []))
    # Steps: the first population, then one per generation.
    done = checkpoint.state.get("steps", 0)
    if done:
        rng.setstate(checkpoint.state["rng"])

    def legal(subnet: Subnet) -> bool:
        if subnet in scores or subnet_params(dim, *subnet) > cfg.max_params:
            return False
        set_subnet(model, subnet)
        scores[subnet] = _accuracy(model, held_out, device)
        return True

    def collect(make, wanted: int) -> list[Subnet]:
        found, tries = [], wanted * 10
        while len(found) < wanted and tries > 0:
            tries -= 1
            subnet = make()
            if legal(subnet):
                found.append(subnet)
        return found

    def step_done(step: int) -> None:
        bar.set_postfix(best=f"{max(scores.values()):.1f}", scored=len(scores))
        bar.update()
        if checkpoint.due():
            checkpoint.save(steps=step + 1, scores=list(scores.items()), rng=rng.getstate())

    total = cfg.search_generations + 1
    bar = progress_bar(
        total=total, initial=done, desc="NOAH evolution", unit="gen", leave=False, show=progress, say=log.info
    )
    if not done:
        if not collect(lambda: random_subnet(depth, rng), cfg.population):
            bar.close()
            raise ValueError(f"no NOAH subnet fits max_params={cfg.max_params} on this backbone")
        step_done(0)
    for step in range(max(done, 1), total):
        top = sorted(scores, key=scores.get, reverse=True)[:SELECT]
        population = collect(lambda top=top: mutate(rng.choice(top), rng), MUTATIONS)
        population += collect(lambda top=top: crossover(rng.choice(top), rng.choice(top), rng), CROSSOVERS)
        collect(lambda: random_subnet(depth, rng), max(0, cfg.population - len(population)))
        step_done(step)
    bar.close()
    best = max(scores, key=scores.get)
    return best, scores[best], len(scores)


def search(
    backbone: nn.Module, cfg: NoahConfig, loader: Iterable, seed: int | None = None, progress: bool = True
) -> Subnet:
    """Search NOAH's subnet for the task of ``loader`` on a copy of ``backbone``.

    Args:
        backbone: the pretrained backbone, before NOAH is applied (left unchanged).
        cfg: the method's config (num_classes, supernet_dim, dropout, init and the search budget).
        loader: the task's training batches ``(images, labels)``, without augmentation.
        seed: seeds the subnet sampling; ``None`` draws it from torch's generator (seeded by the run).
        progress: show progress bars over the supernet's epochs and the evolution's generations (where none is
            drawn, a log file: a few ``NOAH supernet: 50/500 epochs`` lines logged).

    Returns:
        The (prompt, lora, adapter) per-block widths of the best subnet.

    """
    started = time.perf_counter()
    seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed
    rng = random.Random(seed)
    device = next(backbone.parameters()).device
    depth, width = backbone_of(backbone).depth(), cfg.supernet_dim
    full = (width,) * depth
    supernet = surgery.apply(
        copy.deepcopy(backbone),
        "noah",
        num_classes=cfg.num_classes,
        supernet_dim=width,
        dropout=cfg.dropout,
        init=cfg.init,  # NOAH's supernet is built by the same constructor, init_weights included
        prompt=full,
        lora=full,
        adapter=full,
        # The supernet holds every subnet: cfg.max_params bounds the subnets the search keeps, not it (NoahConfig
        # refuses given widths above max_params: the default 640,000 refused the default backbone's 808,152).
        max_params=subnet_params(backbone_of(backbone).width(), full, full, full),
    )
    train, held_out = _split(loader)
    checkpoint = SearchCheckpoint(checkpoint_path(backbone, cfg, seed, train + held_out))
    if checkpoint.state:
        log.info("NOAH search: resuming from %s", checkpoint.path)
    train_supernet(supernet, train, cfg.search_epochs, rng, device, progress, checkpoint)
    trained = time.perf_counter()
    best, accuracy, evaluated = evolve(supernet, held_out, cfg, rng, device, progress, checkpoint)
    checkpoint.finish()
    log.info(
        "NOAH search: supernet %s in %.1f s, %d subnets scored in %.1f s; best held-out top-1 %.2f",
        plural(cfg.search_epochs, "epoch"),
        trained - started,
        evaluated,
        time.perf_counter() - trained,
        accuracy,
    )
    return best


def calibrate_noah(model: nn.Module, cfg: NoahConfig, loader: Iterable, *, progress: bool = True) -> NoahConfig:
    """``cfg`` with the subnet searched on ``loader`` (:func:`search`); unchanged if given."""
    if cfg.searched:
        return cfg
    prompt, lora, adapter = search(model, cfg, loader, progress=progress)
    return dataclasses.replace(cfg, prompt=widths_text(prompt), lora=widths_text(lora), adapter=widths_text(adapter))


register_calibration("noah", calibrate_noah)
