"""The "works with timm" table (docs/works-with.md): what timm's model methods do on each experiment's model."""

from __future__ import annotations

import timm

from petl.model.surgery import apply
from petl.model.timm_api import support
from petl.presets import configs_dir, list_experiments, load_experiment


def support_table() -> str:
    """The Markdown table of :func:`petl.model.timm_api.support` for every experiment (``petl.presets``), on a tiny ViT.

    docs/works-with.md holds its output between ``<!-- works-with -->`` markers (docs/gen.py writes it);
    tests/methods/test_timm_api.py checks that it is current, and prints the table to paste when it is not.
    """
    configs = configs_dir()
    rows = []
    for name in list_experiments(configs):
        options = dict(load_experiment(name, configs).method)
        method = options.pop("name")
        tiny = timm.create_model(
            "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=4
        )
        rows.append((name, method, support(apply(tiny, method, **options))))
    columns = list(rows[0][2])
    lines = ["| experiment | method | " + " | ".join(f"`{c}`" for c in columns) + " |"]
    lines.append("| --- " * (len(columns) + 2) + "|")
    lines += [f"| `{name}` | `{method}` | " + " | ".join(cells.values()) + " |" for name, method, cells in rows]
    return "\n".join(lines) + "\n"
