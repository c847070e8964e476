"""The report's figures, drawn with matplotlib (the ``analyze`` extra) into base64 PNGs.

Each function takes the analysis document and returns a ``data:image/png;base64,...`` URI to
embed in the HTML page (no files, no CDN). matplotlib is imported on first use with the
non-interactive Agg backend, so no display is needed; ImportError says which extra to install.
"""

from __future__ import annotations

import base64
import io
from typing import Any


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the HTML report needs matplotlib: pip install 'kvtier[analyze]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _uri(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _series(doc: dict[str, Any], key: str) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for p in sorted(doc["curve"], key=lambda p: p["capacity_tokens"]):
        xs, ys = out.setdefault(p["policy"], ([], []))
        if p[key] is not None:
            xs.append(p["capacity_tokens"])
            ys.append(p[key])
    return out


def hit_ratio(doc: dict[str, Any]) -> str:
    """Hit ratio vs capacity, one line per policy, Belady dashed, the bound as a ceiling."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (xs, ys) in _series(doc, "hit_ratio").items():
        style = "--" if name == "belady" else "-"
        label = name + (" (default)" if name == doc["default_policy"] else "")
        ax.plot(xs, ys, style, marker="o", label=label)
    ax.axhline(doc["bound"]["hit_ratio"], color="grey", linestyle=":", label="perfect cache (bound)")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens of KV)")
    ax.set_ylabel("prompt tokens served from cache")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Hit ratio by capacity")
    return _uri(fig)


def savings(doc: dict[str, Any]) -> str:
    """Money saved (per day where the log has timestamps) or tokens saved, vs capacity."""
    plt = _plt()
    cost = doc["cost"]
    day = doc["log"]["duration_s"] is not None
    key = ("money_saved_per_day" if day else "money_saved") if cost else \
        ("saved_tokens_per_day" if day else "hit_tokens")
    unit = (f"{cost['currency']} saved" if cost else "prompt tokens saved") + (" per day" if day else " over the log")
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (xs, ys) in _series(doc, key).items():
        ax.plot(xs, ys, "--" if name == "belady" else "-", marker="o", label=name)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens of KV)")
    ax.set_ylabel(unit)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Savings by capacity")
    return _uri(fig)


def ttl(doc: dict[str, Any]) -> str | None:
    """Hit ratio of an unbounded cache vs TTL; None without timestamps."""
    if not doc["ttl"]:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([t["ttl_s"] for t in doc["ttl"]], [t["hit_ratio"] for t in doc["ttl"]], marker="o")
    ax.axhline(doc["bound"]["hit_ratio"], color="grey", linestyle=":", label="no expiry")
    ax.set_xscale("log")
    ax.set_xlabel("TTL (seconds, refreshed on use)")
    ax.set_ylabel("hit ratio")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Hit ratio by TTL (unbounded capacity)")
    return _uri(fig)


def breakers(doc: dict[str, Any]) -> str | None:
    """Tokens each breaker costs; None when none was found."""
    found = doc["breakers"]["found"][:12]
    if not found:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(found)))
    labels = [f"{f['kind']} @{f['start_token']}" for f in found]
    ax.barh(labels[::-1], [f["lost_tokens"] for f in found][::-1], color="#c0392b")
    ax.set_xlabel("prompt tokens lost over the log")
    ax.set_title("Cache breakers")
    return _uri(fig)
