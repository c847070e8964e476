"""``kvtier analyze --fingerprint``: the CI golden-value check on a template's stable prefix,
through the real command (exit status and messages)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvtier.analyze import fingerprint, synth

TEMPLATE = """You are the support assistant of Acme.
Follow the refund policy: refunds within 30 days.
Tools: [{"name": "search_orders"}, {"name": "issue_refund"}]
User {{ user_name }} asks: {{ question }}
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "analyze", *args],
                          capture_output=True, text=True, timeout=300)


def test_unchanged_passes_changed_fails_with_the_place(tmp_path: Path) -> None:
    t = tmp_path / "system.j2"
    t.write_text(TEMPLATE)
    missing = _run("--fingerprint", str(t))
    assert missing.returncode == 2 and "--update" in missing.stderr
    up = _run("--fingerprint", str(t), "--update")
    assert up.returncode == 0, up.stderr
    assert (tmp_path / "system.j2.fingerprint.json").is_file()
    assert _run("--fingerprint", str(t)).returncode == 0
    # text after the first placeholder is not part of the stable prefix
    t.write_text(TEMPLATE.replace("asks:", "wants to know:"))
    assert _run("--fingerprint", str(t)).returncode == 0
    # the tool order changed: fails, naming line 3 and showing both versions
    t.write_text(TEMPLATE.replace('[{"name": "search_orders"}, {"name": "issue_refund"}]',
                                  '[{"name": "issue_refund"}, {"name": "search_orders"}]'))
    r = _run("--fingerprint", str(t))
    assert r.returncode == 1
    assert "first difference at line 3, column 19" in r.stdout
    assert '-Tools: [{"name": "search_orders"}' in r.stdout and '+Tools: [{"name": "issue_refund"}' in r.stdout


def test_a_timestamp_in_the_stable_prefix_is_warned_about(tmp_path: Path) -> None:
    t = tmp_path / "p.txt"
    t.write_text("Now: 2026-12-01T09:00:00Z\nYou are helpful.\n{question}\n")
    r = _run("--fingerprint", str(t), "--update", "--golden", str(tmp_path / "g.json"))
    assert r.returncode == 0 and "line 1, column 6" in r.stderr and "timestamp" in r.stderr


def test_a_placeholder_moved_earlier_is_reported(tmp_path: Path) -> None:
    fp = fingerprint.fingerprint(TEMPLATE)
    golden = fp.to_json("t")
    moved = fingerprint.fingerprint(TEMPLATE.replace("Follow the", "{{ date }} Follow the"))
    (problem,) = fingerprint.check(moved, golden)
    assert "characters shorter" in problem and "line 2, column 1" in problem


def test_same_text_other_tokenizer_is_caught(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(str(synth.build_tokenizer(tmp_path / "a")), local_files_only=True)
    b = AutoTokenizer.from_pretrained(str(synth.build_tokenizer(tmp_path / "b", ["zzz yyy"] * 20)),
                                      local_files_only=True)
    golden = fingerprint.fingerprint(TEMPLATE, lambda s: list(a(s)["input_ids"])).to_json("t")
    same = fingerprint.fingerprint(TEMPLATE, lambda s: list(a(s)["input_ids"]))
    other = fingerprint.fingerprint(TEMPLATE, lambda s: list(b(s)["input_ids"]))
    assert fingerprint.check(same, golden) == []
    (problem,) = fingerprint.check(other, golden)
    assert "same text, different tokens" in problem


def test_unwritable_golden_and_non_utf8_template_are_named(tmp_path: Path) -> None:
    t = tmp_path / "t.txt"
    t.write_text(TEMPLATE)
    nodir = _run("--fingerprint", str(t), "--update", "--golden", str(tmp_path / "nodir" / "g.json"))
    assert nodir.returncode == 2 and "Traceback" not in nodir.stderr
    assert "cannot write golden file" in nodir.stderr and "nodir" in nodir.stderr
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9 {q}\n")
    bad = _run("--fingerprint", str(latin1), "--update")
    assert bad.returncode == 2 and "latin1.txt" in bad.stderr and "not UTF-8" in bad.stderr
