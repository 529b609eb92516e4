"""What a reader sees: tables whole at 80 columns and through a pipe, labels that carry every
override, help texts that fit, progress that reads, and README snippets that run as pasted."""

import io
import json
from pathlib import Path

from rich.console import Console

from _cli import invoke

ROOT = Path(__file__).resolve().parents[2]
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
    # a layer policy: the policy and each layer's pair say the L that ran
    policy = resolve_pair(ROOT / "results/policy/tiny-qwen3.5_tp4_hi16_sr+tp8_hi16_sr_kl1e-3_"
                                 "policy.yaml", 4)
    replayquant.patch(model, policy)
    labels = {label for label, _ in patch_info(model)["layer_pairs"].values()}
    assert labels == {"tp4_hi16_sr@L4", "tp8_hi16_sr@L4"} and policy.label().endswith("@L4")
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


def _command_paths():
    from typer.main import get_command
    from replayquant.cli import app

    def walk(cmd, path):
        yield path
        for name, sub in getattr(cmd, "commands", {}).items():
            if name != "lm-eval" and not sub.hidden:       # lm-eval passes -h to lm-eval
                yield from walk(sub, [*path, name])
    return list(walk(get_command(app), []))


def test_help_fits_80_columns_names_values_and_takes_dash_h():
    from typer.testing import CliRunner
    from replayquant.cli import app
    runner = CliRunner()
    for path in _command_paths():
        res = runner.invoke(app, [*path, "-h"], env={"COLUMNS": "80"})
        text = res.output
        assert res.exit_code == 0 and "Usage:" in text, (path, text)
        assert max(map(len, text.splitlines())) <= 80, (path, text)
        assert "<str>" not in text and "<int>" not in text and "list[" not in text, (path, text)
        assert "calls" not in text, (path, text)       # a tool of this workshop, not replayquant's
    root = runner.invoke(app, ["--help"], env={"COLUMNS": "80"}).output
    assert "--install-completion" in root
    kl = runner.invoke(app, ["kl", "-h"], env={"COLUMNS": "80"}).output
    gpqa = runner.invoke(app, ["gpqa", "-h"], env={"COLUMNS": "80"}).output
    for text in (kl, gpqa):
        assert "--device " in text and "--dtype DTYPE" in text and "--device-map" not in text
        dtype = " ".join(text[text.index("--dtype"):].split("--", 2)[1].split())
        assert "[default: auto]" in dtype, dtype
    assert "--buffer-len" in kl and "--pair PAIR" in kl


def test_kl_takes_buffer_len_and_the_old_device_spelling_with_a_note(monkeypatch, tmp_path):
    from replayquant.kl import command as C
    seen = {}
    monkeypatch.setattr(C, "kl_command", lambda model, pairs, settings, **kw: seen.update(
        pairs=pairs, device_map=settings.device_map, **kw))
    code, text = invoke(["kl", "--model", "tiny-qwen3.5", "--pair", "tp4_hi16_sr", "--buffer-len",
                         4, "--device-map", "cpu", "--dataset", "heldout", "--context", 64])
    assert code == 0, text
    assert [p.label() for p in seen["pairs"]] == ["tp4_hi16_sr@L4"] and seen["device_map"] == "cpu"
    assert "--device-map is deprecated" in text and "tp4_hi16_sr-L4" in seen["out"]
    code, text = invoke(["kl", "--model", "tiny-qwen3.5", "--pair", "s32_rs", "--device", "cpu",
                         "--device-map", "cpu"])
    assert code == 2 and "give --device alone" in text, text


def test_drift_shows_a_progress_bar_and_no_source_paths(tmp_path):
    code, text = invoke(["drift", "--kind", "mamba2", "--pair", "s32_rs", "--steps", 20,
                         "--seeds", "1,2", "--out", tmp_path])
    assert code == 0, text
    assert "80/80 steps" in text, text             # 2 seeds x (replay + conventional) x 20 steps
    assert ".py:" not in text and "seed 2 s32_rs conventional" in text, text


def test_transformers_warnings_print_above_a_progress_bar():
    from rich.progress import Progress
    from transformers.utils import logging as hf_logging
    from replayquant.cli.common import library_logs_above_bars
    library_logs_above_bars()
    buf = io.StringIO()
    level = hf_logging.get_verbosity()            # other test modules silence transformers
    hf_logging.set_verbosity_warning()
    try:
        with Progress(console=Console(file=buf, force_terminal=True, width=80)) as bar:
            bar.add_task("KL", total=2)
            hf_logging.get_logger("transformers.integrations").warning("falls back to PyTorch")
    finally:
        hf_logging.set_verbosity(level)
    assert "falls back to PyTorch" in buf.getvalue()


def test_recommend_per_layer_names_each_file_once(monkeypatch, tmp_path):
    from replayquant.kl import command as C
    from replayquant.sweep import per_layer
    sens = ROOT / "results/sensitivity/tiny-qwen3.5_tp4_hi16_sr+tp8_hi16_sr_ctx2k.json"
    kl = json.loads((ROOT / "results/policy/tiny-qwen3.5_tp4_hi16_sr+tp8_hi16_sr_kl1e-3_kl.json")
                    .read_text())

    def kl_run(model, pairs, settings, out, **kw):  # the measured policy, as the KL run says it
        print(f"wrote {out}, {Path(out).with_suffix('.png')} and {Path(out).with_suffix('.kl')}/")
        return {**kl, "results": {pairs[0].name: next(iter(kl["results"].values()))}}
    monkeypatch.setattr(C, "kl_command", kl_run)
    monkeypatch.setattr(per_layer, "plot_results_file", lambda *a, **k: None)
    monkeypatch.setattr(per_layer, "check_same_model", lambda *a: {"model": "tiny-qwen3.5"})
    monkeypatch.setattr(per_layer, "check_same_data", lambda *a: None)
    code, text = invoke(["recommend", "--per-layer", sens, "--kl-budget", "1e-3", "--out",
                         tmp_path / "rec.json", "--no-progress"])
    assert code in (0, 1), text
    flat = text.replace("\n", "")
    assert flat.count("rec_kl.json") == 1 and flat.count("rec_policy.yaml") == 1, text


def test_a_mean_kl_of_float_noise_reads_as_zero_with_a_word(tmp_path):
    from replayquant.kl.report import print_summary
    res = json.loads((ROOT / "results/demo/tiny-qwen3.5_ctx16k_cpu.json").read_text())
    res["results"]["s32_rs"].update(kl_mean=-3e-10, kl_mean_unc=4.3e-10)     # within 3 SE of 0
    res["results"]["sbf16"].update(kl_mean=-1e-6, kl_mean_unc=1e-8)          # far below: a defect
    f = tmp_path / "kl.json"
    f.write_text(json.dumps(res))
    buf = io.StringIO()
    print_summary(res, Console(file=buf, width=80))
    code, md = invoke(["table", f])
    assert code == 0, md
    for text in (buf.getvalue(), md):
        words = " ".join(text.split())
        assert "-3e-10" not in words and "~0" in words, text
        assert "within 3 standard errors of zero" in words and "(<0)" in words, text


def test_llama_format_has_llamas_chunk_table_and_no_statistics_below_100_tokens(tmp_path):
    import re
    out = tmp_path / "kl.json"                      # 2 documents x 64 tokens: 126 positions scored
    code, text = invoke(["kl", "--model", "tiny-qwen3.5", "--pair", "f4_sr_rs", "--dataset",
                         "heldout", "--context", 64, "--docs", 2, "--segment", 32, "--dtype",
                         "float32", "--reference", "hf", "--no-progress", "--out", out])
    assert code == 0, text
    code, text = invoke(["table", out, "--format", "llama"])
    assert code == 0, text
    head = "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
    assert text.count(head) == 1, text
    chunks = [ln for ln in text.splitlines() if re.match(r"^ {3}[12] {4}", ln)]
    assert len(chunks) == 2 and chunks[1].endswith("%"), text
    last_kl = float(chunks[1].split("±")[2].split()[-1])        # running KL after both chunks
    mean = float(re.search(r"Mean    KLD: +([-\d.]+)", text).group(1))
    assert abs(last_kl - mean) < 1e-5, text
    # llama.cpp's window: 31 positions of each document, 62 in all: no statistics block
    code, text = invoke(["table", out, "--format", "llama", "--scoring", "llama"])
    assert code == 0 and text.count(head) == 1, text
    assert "Mean    KLD" not in text and "fewer than 100" in text, text


def test_shipped_tokenizers_pad_on_the_left_so_batched_generate_is_each_prompts(caplog):
    import torch
    from transformers import AutoTokenizer
    import replayquant
    from replayquant.data import tiny_model_path
    for name in ("tiny-qwen3.5", "tiny-mamba2", "tiny-kimi-linear"):
        assert AutoTokenizer.from_pretrained(tiny_model_path(name)).padding_side == "left", name
    tok = AutoTokenizer.from_pretrained(tiny_model_path("tiny-qwen3.5"))
    model = replayquant.load_model("tiny-qwen3.5", "tp4_hi16_sr", dtype="float32")
    prompts = ["In the beginning God created", "And he said"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    with caplog.at_level("WARNING"):
        out = model.generate(**batch, max_new_tokens=5, do_sample=False)[:, -5:]
    assert "padding" not in caplog.text, caplog.text        # HF warns of right padding
    for row, prompt in zip(out, prompts):
        alone = model.generate(**tok([prompt], return_tensors="pt"), max_new_tokens=5,
                               do_sample=False)
        assert torch.equal(row, alone[0, -5:]), prompt


def test_readme_python_snippets_run_as_pasted(monkeypatch, tmp_path):
    import re
    import lm_eval
    from lm_eval.tasks import TaskManager
    from replayquant.gpqa.tasks import write_task_dir
    # GPQA from the test CSV (the hub's is gated), as `replayquant gpqa --gpqa-csv` reads it, and
    # one question (each takes 2 s of replay prefill on a CPU)
    tasks = TaskManager(include_path=str(write_task_dir(ROOT / "tests/data/gpqa_tiny.csv",
                                                        tmp_path / "tasks")), include_defaults=False)
    evaluate = lm_eval.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate",
                        lambda **kw: evaluate(task_manager=tasks, **{**kw, "limit": 1}))
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) == 4
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
