"""FractalDB-style images for formula-driven pretraining (after Kataoka et al., ACCV 2020).

A class is a random iterated function system (IFS): a few 2-D affine maps chosen with
probability proportional to their |determinant|.  Systems whose attractor covers too little of
the canvas are rejected (the "fill rate" filter), so every class is a visible shape.  Instances
of a class perturb one map parameter by a factor near 1 and flip the result, so a class is a
family of similar fractals rather than one picture.

Rendering runs many independent chaos-game chains at once in numpy, which is what makes
generation fast enough (thousands of images per second on one core at 32 px).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import TensorDataset

from petl.data.transforms import normalize


@dataclass(frozen=True)
class FractalConfig:
    """How FractalDB-style classes and instances are drawn.

    Attributes:
        num_classes: number of IFS systems (classes).
        instances: images per class.
        image_size: canvas side in pixels.
        min_maps: fewest affine maps per system.
        max_maps: most affine maps per system.
        fill_threshold: minimum fraction of canvas pixels the attractor must cover.
        chains: parallel chaos-game chains per image.
        steps: iterations per chain (the first few are discarded as burn-in).
        perturb: instance parameter factor drawn from [1 - perturb, 1 + perturb].
        seed: seed of the whole database (same seed, same images on every machine).
    """

    num_classes: int = 100
    instances: int = 100
    image_size: int = 32
    min_maps: int = 2
    max_maps: int = 4
    fill_threshold: float = 0.12
    chains: int = 512
    steps: int = 24
    perturb: float = 0.2
    seed: int = 0


BURN_IN = 8


def random_system(rng: np.random.Generator, num_maps: int) -> np.ndarray:
    """A random IFS: ``num_maps`` rows of affine parameters (a, b, c, d, e, f) in [-1, 1]."""
    return rng.uniform(-1.0, 1.0, size=(num_maps, 6))


def render(system: np.ndarray, size: int, rng: np.random.Generator, chains: int = 512, steps: int = 24) -> np.ndarray:
    """Render an IFS attractor to a ``size``x``size`` uint8 image by the chaos game.

    Args:
        system: (maps, 6) affine parameters; map k sends (x, y) to (a x + b y + e, c x + d y + f).
        size: canvas side in pixels.
        rng: random generator choosing the maps.
        chains: independent chains iterated in parallel.
        steps: iterations per chain.

    Returns:
        The image (0 background, 255 on the attractor), or an all-zero image when the
        attractor diverges or collapses.
    """
    a, b, c, d, e, f = system.T
    det = np.abs(a * d - b * c)
    prob = det / det.sum() if det.sum() > 0 else np.full(len(system), 1.0 / len(system))
    xy = rng.uniform(-1, 1, size=(chains, 2))
    points = []
    for step in range(steps):
        k = rng.choice(len(system), size=chains, p=prob)
        x, y = xy[:, 0], xy[:, 1]
        xy = np.stack([a[k] * x + b[k] * y + e[k], c[k] * x + d[k] * y + f[k]], axis=1)
        if step >= BURN_IN:
            points.append(xy)
    pts = np.concatenate(points)
    image = np.zeros((size, size), dtype=np.uint8)
    if not np.isfinite(pts).all():
        return image
    lo, hi = pts.min(0), pts.max(0)
    span = (hi - lo).max()
    if span < 1e-6:
        return image
    # Fit the attractor into the canvas with a 1-pixel margin, keeping its aspect ratio.
    scaled = (pts - (lo + hi) / 2) / span * (size - 2) + size / 2
    cols, rows = np.clip(scaled.astype(int), 0, size - 1).T
    image[rows, cols] = 255
    return image


def fill_rate(image: np.ndarray) -> float:
    """Fraction of pixels the attractor covers."""
    return float((image > 0).mean())


def search_systems(config: FractalConfig) -> list[np.ndarray]:
    """Draw random systems until ``config.num_classes`` pass the fill-rate filter."""
    rng = np.random.default_rng(config.seed)
    systems = []
    while len(systems) < config.num_classes:
        system = random_system(rng, int(rng.integers(config.min_maps, config.max_maps + 1)))
        if fill_rate(render(system, config.image_size, rng, config.chains, config.steps)) >= config.fill_threshold:
            systems.append(system)
    return systems


def instance(system: np.ndarray, config: FractalConfig, rng: np.random.Generator) -> np.ndarray:
    """One image of a class: one parameter perturbed, then a random flip."""
    varied = system.copy()
    row, col = rng.integers(len(system)), rng.integers(6)
    varied[row, col] *= rng.uniform(1 - config.perturb, 1 + config.perturb)
    image = render(varied, config.image_size, rng, config.chains, config.steps)
    if rng.random() < 0.5:
        image = image[:, ::-1]
    if rng.random() < 0.5:
        image = image[::-1, :]
    return np.ascontiguousarray(image)


def generate(config: FractalConfig, systems: list[np.ndarray] | None = None, seed: int | None = None) -> TensorDataset:
    """Generate ``instances`` images for every class as a TensorDataset of (uint8 [1,H,W], label).

    Args:
        config: the database settings.
        systems: the classes (from :func:`search_systems`); searched from ``config.seed`` if None.
        seed: seed of the instance draws (defaults to ``config.seed + 1``), so a second call with
            another seed gives fresh instances of the same classes, e.g. a validation split.
    """
    systems = search_systems(config) if systems is None else systems
    rng = np.random.default_rng(config.seed + 1 if seed is None else seed)
    images = np.empty((len(systems) * config.instances, 1, config.image_size, config.image_size), dtype=np.uint8)
    labels = np.repeat(np.arange(len(systems)), config.instances)
    for i, label in enumerate(labels):
        images[i, 0] = instance(systems[label], config, rng)
    return TensorDataset(torch.from_numpy(images), torch.from_numpy(labels).long())


def to_model_input(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 [N,1,H,W] fractals → normalised float [N,3,H,W] for an RGB ViT (petl.data's normaliser)."""
    return normalize(images.float().div_(255).expand(-1, 3, -1, -1), mean, std)
