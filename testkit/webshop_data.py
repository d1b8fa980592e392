"""The shared WebShop data (``shared/data/webshop``) as the tests use it: where it is, a skip marker
for machines without it, and the golden-case world of shared/specs/webshop.md §9.

The spec computed its golden cases on 160 products rebuilt from the look-alike files (its §9
"Fixture"); :func:`golden_world` rebuilds exactly that fixture from the shared data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.envs.webshop.data import WebShopWorld, build_world, read_attributes, read_raw_products

#: The shared WebShop data, beside the repository (``../shared`` of its root).
DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "webshop"
#: The look-alike product files (``lookalike_v_color.json``, ...).
LOOKALIKE_DIR = DATA_DIR / "lookalike"

#: Skips a test where the shared WebShop data (with its look-alike files) is not on this machine.
needs_data = pytest.mark.skipif(
    not (LOOKALIKE_DIR / "lookalike_v_size.json").is_file(),
    reason=f"WebShop data not found at {DATA_DIR} (shared/data/webshop with its lookalike/ folder)",
)


def rebuild_golden_products() -> list[dict[str, Any]]:
    """The spec's §9 fixture: v_color records of ASINs in both v_color and v_size, colours from v_size."""
    color = read_raw_products(LOOKALIKE_DIR / "lookalike_v_color.json")
    size = {r["asin"].removeprefix("LK_SIZE_"): r for r in read_raw_products(LOOKALIKE_DIR / "lookalike_v_size.json")}
    products = []
    for record in color:
        base = record["asin"].removeprefix("LK_COLOR_")
        if base not in size:
            continue
        rebuilt = json.loads(json.dumps(record))
        rebuilt["asin"] = base
        rebuilt["customization_options"]["Color"] = size[base]["customization_options"]["Color"]
        products.append(rebuilt)
    return products


def golden_world(with_lookalikes: bool = False) -> WebShopWorld:
    """A world over the rebuilt fixture (optionally with the three look-alike files appended)."""
    extras: list[dict[str, Any]] = []
    if with_lookalikes:
        for name in ("v_color", "v_size", "v_price_color"):
            extras += read_raw_products(LOOKALIKE_DIR / f"lookalike_{name}.json")
    return build_world(rebuild_golden_products(), read_attributes(DATA_DIR / "items_ins_v2_1000.json"),
                       extra_products=extras)
