"""The save-throughput figures of bench/e2e_vllm.py as paired ratios, and a phase that runs
only those (``python bench/e2e_vllm.py --quick --save-only``: the three save phases without
the TTFT, one-chunk and batch phases, for measuring a change to the save path quickly).

A save ratio is the median of ``on_i / off_i`` over adjacent (saving, off) runs: one batch
takes seconds while this machine's speed drifts over minutes, so a pair sees one spell on both
sides, where the median of the "on" runs and that of the "off" runs may come from different
spells. The ratio of the two medians (the figure before pairing) is printed beside it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench._stats import fmt, median


def pair_ratios(on: list[float], off: list[float]) -> list[float]:
    """``on[i] / off[i]`` of each adjacent pair ((saving, off) throughputs; (warm, floor) TTFTs)."""
    if len(on) != len(off) or not on:
        raise ValueError(f"unpaired runs: {len(on)} on, {len(off)} off")
    return [a / b for a, b in zip(on, off)]


def pair_line(on: list[float], off: list[float]) -> str:
    """The per-pair ratios as min/median/max, and the ratio of the medians beside them."""
    return f"{fmt(pair_ratios(on, off), '', 3)}; ratio of medians {median(on) / median(off):.3f}"


def files(root: Path) -> int:
    """Regular files under ``root`` (the disk tier keeps one per chunk)."""
    return sum(1 for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def disk_throughput(b: Any, plain: Any) -> tuple[list[float], list[float], int]:
    """The disk phase: a disk-only replica (no cpu tier) against ``plain``, paired as in
    ``throughput_pair``; (tok/s saving on, tok/s off, chunk files the disk tier gained)."""
    disk_dir = b.work / "disk"
    disk = b.replica("disk", {"cpu": {"enabled": False},
                              "disk": {"enabled": True, "path": str(disk_dir), "capacity_bytes": "4GiB"}})
    before = files(disk_dir)
    try:
        on, off = b.throughput_pair(plain, disk)
    finally:
        disk.close()
    return on, off, files(disk_dir) - before


def save_only(b: Any) -> dict[str, Any]:
    """The cpu, disk and remote save phases of bench/e2e_vllm.py (same engines, same tiers,
    same paired measurement), nothing else; returns their JSON keys."""
    from bench.e2e_vllm import server_stored
    from tests.kvtier_servers import start_server

    res: dict[str, Any] = {"quick": b.quick, "save_only": True, "offered_chunks": b.offered_chunks()}
    runs: dict[str, list[float]] = {}
    plain = b.replica("plain", None)
    try:
        cpu = b.replica("cpu", {"cpu": {"capacity_bytes": "1GiB", "slot_bytes": "4MiB"}})
        try:
            runs["tok_s_on"], runs["tok_s_off"] = b.throughput_pair(plain, cpu)
        finally:
            cpu.close()
        runs["tok_s_on_disk"], runs["tok_s_off_disk_phase"], res["saved_chunks_disk"] = disk_throughput(b, plain)
        server = start_server(b.work / "server", "--cpu-bytes", "1GiB", "--slot-bytes", "4MiB", timeout=60)
        try:
            remote = b.replica("remote", {"cpu": {"enabled": False}, "grpc": {
                "enabled": True, "nodes": [server.address], "timeout_s": 5.0}})
            try:
                before = server_stored(server)
                runs["tok_s_on_remote"], runs["tok_s_off_remote_phase"] = b.throughput_pair(plain, remote)
                time.sleep(1.0)  # let the last queued saves land before counting
                res["saved_chunks_remote"] = server_stored(server) - before
            finally:
                remote.close()
        finally:
            server.stop()
    finally:
        plain.close()
    for key, on, off in (("save_throughput_ratio", "tok_s_on", "tok_s_off"),
                         ("save_throughput_ratio_disk", "tok_s_on_disk", "tok_s_off_disk_phase"),
                         ("save_throughput_ratio_remote", "tok_s_on_remote", "tok_s_off_remote_phase")):
        print(f"{key:29} per pair {pair_line(runs[on], runs[off])}")
        res[key] = median(pair_ratios(runs[on], runs[off]))
        res[f"{key}_of_medians"] = median(runs[on]) / median(runs[off])
    res["runs"] = runs
    return res
