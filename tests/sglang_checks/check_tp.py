"""Two real TP ranks (two processes, gloo): SGLang MIN-reduces KVTierStorage.batch_exists.

Rank 0 backs up 5 pages, rank 1 only 2: each rank's backend counts its own leading pages, and
the controller's TP reduction makes both ranks use 2 pages, never a page one rank lacks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_two_tp_ranks_agree_on_the_min_leading_hit(tmp_path: Path) -> None:
    init, disk = tmp_path / "pg", tmp_path / "disk"
    procs = [subprocess.Popen([sys.executable, str(HERE / "tp_worker.py"), str(rank), str(init), str(disk),
                               str(pages), str(tmp_path / f"r{rank}.json")], env=dict(os.environ))
             for rank, pages in ((0, 5), (1, 2))]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:  # a rank left waiting at a collective when its peer died
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    assert (r0["backed_up_tokens"], r1["backed_up_tokens"]) == (20, 8)
    assert (r0["local_exists_pages"], r1["local_exists_pages"]) == (5, 2)
    assert r0["tp_min_hit_tokens"] == r1["tp_min_hit_tokens"] == 8
