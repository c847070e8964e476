"""Money: what a prefix cache saves at a hit count, from an editable price table.

A price table is a YAML (or JSON) file in the shape providers publish their prices in: per
model, the price of a million input tokens, and what a cached read and a cache write cost,
either as multipliers of the input price or as their own per-million prices::

    currency: USD
    models:
      - model: example-large
        input_per_mtok: 3.00
        cache_read_multiplier: 0.10     # or cache_read_per_mtok: 0.30
        cache_write_multiplier: 1.25    # or cache_write_per_mtok: 3.75

No price lives in code: examples ship in ``kvtier/analyze/prices/``; edit or copy them. The
model: every prompt token a cache serves is billed as a cached read, every other prompt token
as a cache write (the replay writes every miss); without a cache all are billed as input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import not_utf8

EXAMPLES_DIR = Path(__file__).with_name("prices")


class PriceError(ValueError):
    """The price table is missing, malformed, or lacks the requested model."""


@dataclass(frozen=True)
class Price:
    model: str
    currency: str
    input_per_mtok: float
    cache_read_multiplier: float
    cache_write_multiplier: float

    def cost(self, prompt_tokens: int, hit_tokens: int) -> float:
        """What ``prompt_tokens`` cost when ``hit_tokens`` of them are served from the cache."""
        miss = prompt_tokens - hit_tokens
        return self.input_per_mtok * (hit_tokens * self.cache_read_multiplier +
                                      miss * self.cache_write_multiplier) / 1e6

    def saved(self, prompt_tokens: int, hit_tokens: int) -> float:
        """Cost without a cache minus cost with it (negative where writes cost more than hits save)."""
        return self.input_per_mtok * prompt_tokens / 1e6 - self.cost(prompt_tokens, hit_tokens)


def _number(entry: dict[str, Any], name: str, where: str) -> float | None:
    v = entry.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise PriceError(f"{where}: {name!r} must be a non-negative number, got {v!r}")
    return float(v)


def _multiplier(entry: dict[str, Any], kind: str, base: float, where: str) -> float:
    mult = _number(entry, f"cache_{kind}_multiplier", where)
    per = _number(entry, f"cache_{kind}_per_mtok", where)
    if mult is not None and per is not None:
        raise PriceError(f"{where}: give cache_{kind}_multiplier or cache_{kind}_per_mtok, not both")
    if per is not None:
        return per / base if base else 0.0
    if mult is None:
        raise PriceError(f"{where}: missing cache_{kind}_multiplier (or cache_{kind}_per_mtok)")
    return mult


def load_prices(path: str | Path) -> list[Price]:
    """Every model of the price table at ``path``; raises PriceError naming what is wrong."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PriceError(f"price table {str(p)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise PriceError(f"price table {str(p)!r}: {not_utf8(exc)}") from None
    try:
        doc = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise PriceError(f"price table {str(p)!r}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list) or not doc["models"]:
        raise PriceError(f"price table {str(p)!r}: expected a mapping with a non-empty 'models' list")
    currency = str(doc.get("currency", "USD"))
    out = []
    for i, entry in enumerate(doc["models"]):
        where = f"price table {str(p)!r}, models[{i}]"
        if not isinstance(entry, dict) or not entry.get("model"):
            raise PriceError(f"{where}: each entry needs a 'model' name")
        base = _number(entry, "input_per_mtok", where)
        if base is None:
            raise PriceError(f"{where}: missing 'input_per_mtok'")
        out.append(Price(str(entry["model"]), currency, base, _multiplier(entry, "read", base, where),
                         _multiplier(entry, "write", base, where)))
    return out


def select(prices: list[Price], model: str | None) -> Price:
    """The entry named ``model``, or the first one when ``model`` is None."""
    if model is None:
        return prices[0]
    for price in prices:
        if price.model == model:
            return price
    raise PriceError(f"--price-model {model!r} is not in the price table; it has {[p.model for p in prices]}")
