"""What a reader sees: tables whole at 80 columns and through a pipe, labels that carry every
override, help texts that fit, progress that reads, and README snippets that run as pasted."""

import io
import json
from pathlib import Path

from rich.console import Console

from _cli import invoke

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "results/demo/tiny-qwen3.5_sweep.json"


def _md_header(text: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith("| variant"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_sweep_table_keeps_every_number_whole_at_80_columns_and_piped(capsys):
    from replayquant.sweep.command import print_sweep
    sw = json.loads(SWEEP.read_text())
    buf = io.StringIO()
    print_sweep(sw, Console(file=buf, width=80))
    print_sweep(sw)                                  # piped (pytest captures): rich's 80 columns
    for text in (buf.getvalue(), capsys.readouterr().out):
        assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
        assert "0.0449" in text                      # f4_sr_rs@L8's KL upper bound, whole
        words = " ".join(text.split())
        assert "left out at 80 columns" in words and "replayquant table SWEEP.json" in words
    # `table` reprints a sweep with every column, each headed once
    code, md = invoke(["table", SWEEP])
    assert code == 0, md
    head = _md_header(md)
    assert len(head) == len(set(head)) and {"KL upper", "memory", "us/step"} <= set(head), head
    assert md.count("@L") >= len(sw["variants"]) and "~0" in md      # s32_rs: float noise
    code, csv = invoke(["table", SWEEP, "--format", "csv"])
    assert code == 0 and csv.splitlines()[0].startswith("variant,") and len(csv.splitlines()) == 17
