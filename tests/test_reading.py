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


def test_a_buffer_length_override_stays_in_every_label(tmp_path):
    import replayquant
    from replayquant.models import patch_info
    from replayquant.policy import resolve_pair
    assert resolve_pair("tp4_hi16_sr", "4").label() == "tp4_hi16_sr@L4"    # lm-eval's buffer_len=4
    assert resolve_pair("tp4_hi16_sr", 16).label() == "tp4_hi16_sr"        # the pair's own L
    model = replayquant.load_model("tiny-qwen3.5", "tp4_hi16_sr", buffer_len=4, dtype="float32")
    info = patch_info(model)
    assert info["pair"].label() == "tp4_hi16_sr@L4"
    assert {label for label, _ in info["layer_pairs"].values()} == {"tp4_hi16_sr@L4"}
    # lm-eval results as `replayquant lm-eval` (pair=tp4_hi16_sr,buffer_len=4) and as `gpqa`
    # writes them per pair (its config names the model by path, no model_args)
    base = json.loads((ROOT / "tests/data/lm_eval/tiny-qwen35_s32_rs_results.json").read_text())
    pair = resolve_pair("tp4_hi16_sr", "4")
    base["config"]["replayquant"].update(pair=pair.to_dict(), pair_label=pair.label())
    base["config"]["model_args"].update(pair="tp4_hi16_sr", buffer_len="4")
    lm_eval_file = tmp_path / "lm_eval.json"
    lm_eval_file.write_text(json.dumps(base))
    base["config"].update(model="/elsewhere/tiny-qwen3.5", model_args=None)
    del base["model_name"]
    base["replayquant"] = {"pair": pair.to_dict(), "pair_label": pair.label(),
                           "provenance": {"model": "tiny-qwen3.5"}}
    gpqa_file = tmp_path / "tp4_hi16_sr@L4.json"
    gpqa_file.write_text(json.dumps(base))
    code, md = invoke(["table", lm_eval_file, gpqa_file])
    assert code == 0, md
    rows = md.splitlines()[2:]
    rows = rows[:rows.index("")] if "" in rows else rows
    assert rows and all("| tp4_hi16_sr@L4 |" in r for r in rows), md
    models = {r.split("|")[1].strip() for r in rows}
    assert models == {"tiny-qwen35", "tiny-qwen3.5"}, md
