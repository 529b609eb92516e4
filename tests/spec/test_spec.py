"""`replayquant spec` on the embedded tiny-qwen3.5: one short run (one document, a 48-token
prompt, 12 new tokens) through the command line, read back by the tests below; bad input is
one error before the model loads.

The FP32 pairs (the reference, s32_rs) give the reference's greedy tokens under prompt lookup;
the counts HF's loop reported (drafts and accepted drafts per verify round, through the candidate
generator) agree with the target's forwards counted by a hook and with the tokens generated; the
results file carries its provenance; the table fits 80 columns; the same command resumes from
the file, and another configuration into it is refused. A sampled run (--temperature) samples
with the same random draws in every variant.
"""

import json

import pytest

from _cli import invoke, one_clear_error

ARGS = ["spec", "--model", "tiny-qwen3.5", "--pair", "s32_rs", "--pair", "tp4_hi16_sr",
        "--context", 48, "--new-tokens", 12, "--docs", 1, "--dtype", "float32",
        "--device", "cpu", "--draft-tokens", 3, "--no-progress"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(results dict, command output, --out) of one run."""
    out = tmp_path_factory.mktemp("spec") / "tiny.json"
    code, text = invoke(ARGS + ["--out", out])
    assert code == 0, text
    return json.loads(out.read_text()), text, out


def test_fp32_pairs_give_the_references_tokens(run):
    res, _, _ = run
    doc = res["per_document"][0]["pairs"]
    ref = doc["reference"]["plain"]["tokens"]
    assert len(ref) == 12
    for name in ("reference", "s32_rs"):
        assert doc[name]["lookup"]["tokens"] == ref
        s = res["results"][name]["lookup"]
        assert s["agree_ref"] == s["agree_ref_prefix"] == s["agree_plain"] == 1.0
    assert res["results"]["reference"]["plain"]["agree_ref"] == 1.0


def test_counts_are_consistent(run):
    """Every speculative record: one verify round per target forward, each round's accepted
    drafts within its drafts, and accepted drafts + forwards = tokens generated; the summary
    adds up the records."""
    res, _, _ = run
    for name, row in res["results"].items():
        rec = res["per_document"][0]["pairs"][name]["lookup"]
        rounds = rec["rounds"]
        assert rec["forwards"] == len(rounds) > 0
        assert all(0 <= a <= d <= 3 for d, a in rounds)
        assert sum(a for _, a in rounds) + rec["forwards"] == rec["generated"] == 12
        assert res["per_document"][0]["pairs"][name]["plain"]["forwards"] == 12
        s = row["lookup"]
        assert s["accepted"] + s["forwards"] == s["generated"]
        assert s["tokens_per_forward"] == pytest.approx(12 / rec["forwards"])
        assert len(s["acceptance_by_position"]) == 3
        assert s["tok_s"] > 0 and s["plain_tok_s"] > 0


def test_provenance_table_and_plot(run):
    res, text, out = run
    assert res["kind"] == "replayquant-spec" and res["complete"]
    prov = res["provenance"]
    for key in ("git_commit", "device", "versions", "model", "pairs", "buffer_len",
                "data_fingerprint", "seed"):
        assert key in prov, key
    assert prov["pairs"] == ["reference", "s32_rs", "tp4_hi16_sr"]
    assert prov["data_fingerprint"] == res["config"]["data"]["tokens_sha256"]
    rows = [line for line in text.splitlines() if line.startswith(("pair", "-", "reference",
                                                                  "s32_rs", "tp4_hi16_sr"))]
    assert len(rows) == 5 and all(len(line) <= 80 for line in rows)
    assert out.with_suffix(".png").stat().st_size > 0


def test_other_configuration_is_refused(run, monkeypatch):
    """Another configuration into the same --out is one error before the weights load."""
    _, _, out = run
    from replayquant.kl import command as C
    monkeypatch.setattr(C, "load_weights", lambda *a, **k: pytest.fail("the weights loaded"))
    code, text = invoke(ARGS + ["--new-tokens", 8, "--out", out])
    one_clear_error(code, text, "different configuration", "new_tokens")


def test_resumes_finished_documents(run, monkeypatch):
    res, _, out = run
    from replayquant.spec import command as C
    monkeypatch.setattr(C._Run, "_document", lambda *a: pytest.fail("a finished document ran"))
    code, text = invoke(ARGS + ["--out", out])
    assert code == 0, text
    assert "resuming" in text
    assert json.loads(out.read_text())["per_document"] == res["per_document"]


def test_sampled_run(run, tmp_path):
    """--temperature 1: plain decode and prompt lookup sample (other tokens than the greedy run's),
    every variant with the same random draws per document and method, so the FP32 pairs give the
    reference's tokens; the counts add up as greedy's, the table says what it compares, and the
    results record the sampling options."""
    out = tmp_path / "sampled.json"
    code, text = invoke(ARGS[:5] + ARGS[7:] + ["--temperature", 1, "--top-p", 0.9,
                                              "--out", out])
    assert code == 0, text
    res = json.loads(out.read_text())
    assert res["config"]["sampling"] == {"temperature": 1.0, "top_p": 0.9, "top_k": 0}
    assert "sampling" not in run[0]["config"]
    doc = res["per_document"][0]["pairs"]
    greedy = run[0]["per_document"][0]["pairs"]["reference"]["plain"]["tokens"]
    assert doc["reference"]["plain"]["tokens"] != greedy
    for method in ("plain", "lookup"):
        assert doc["s32_rs"][method]["tokens"] == doc["reference"][method]["tokens"]
        assert res["results"]["s32_rs"][method]["agree_ref"] == 1.0
    rec = doc["s32_rs"]["lookup"]
    assert sum(a for _, a in rec["rounds"]) + rec["forwards"] == rec["generated"] == 12
    assert "agree_plain" not in rec and res["results"]["s32_rs"]["lookup"]["agree_plain"] is None
    assert "sampled (temperature 1, top-p 0.9, top-k 0)" in text


def test_top_k_one_sampling_is_greedy():
    """counted_generate sampling among the likeliest token only gives greedy's tokens and
    rounds, prompt lookup and plain."""
    import torch
    from replayquant.models import load_model
    from replayquant.spec import counted_generate
    model = load_model("tiny-qwen3.5", "s32_rs", dtype="float32")
    ids = torch.arange(2, 14).repeat(3)[None]
    for kw in ({}, {"prompt_lookup_num_tokens": 3}):
        greedy = counted_generate(model, ids, 10, **kw)
        top1 = counted_generate(model, ids, 10, {"temperature": 1.0, "top_p": 1.0, "top_k": 1},
                                seed=5, **kw)
        assert (top1.tokens, top1.rounds) == (greedy.tokens, greedy.rounds)


@pytest.mark.parametrize("extra, needles", [
    (["--temperature", -1], ["--temperature must be a number >= 0"]),
    (["--temperature", 1, "--top-p", 0], ["--top-p must be a number in (0, 1]"]),
    (["--top-k", 3], ["--top-k 3 shape sampling", "--temperature above 0"]),
    (["--draft-tokens", 20], ["--draft-tokens 20", "L = 16"]),
    (["--no-lookup"], ["--no-lookup without --assistant"]),
    (["--new-tokens", 0], ["--new-tokens must be an integer >= 1"]),
    (["--out", "x.txt"], ["ending in .json"]),
])
def test_bad_options_are_one_error(extra, needles, no_model):
    code, text = invoke(ARGS + extra)
    one_clear_error(code, text, *needles)


def test_readme_table_is_the_committed_result():
    """The README's speculative-decoding table is results/spec/tiny-qwen3.5.json's."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    res = json.loads((root / "results/spec/tiny-qwen3.5.json").read_text())["results"]
    readme = (root / "README.md").read_text()
    start = readme.index("| tiny-qwen3.5 |")
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in readme[start:readme.index("\n\n", start)].splitlines()]
    assert rows[0][1:] == list(res)
    for label, key, fmt in (("tokens / forward", "tokens_per_forward", "{:.2f}"),
                            ("same tokens as reference", "agree_ref", "{:.2f}"),
                            ("speculative / plain tok/s", "speedup", "{:.2f}x")):
        row = next(r for r in rows if r[0] == label)
        assert row[1:] == [fmt.format(res[n]["lookup"][key]) for n in res], label
    assert re.search(r"prompt_lookup_num_tokens=4", readme)


def test_recommend_min_accept(tmp_path):
    """`recommend --spec --min-accept`: the demo sweep (its model record set to the spec run's,
    which fingerprinted the same model whole) considers only the variants whose pair at its L
    accepted enough drafts per round; other files and values are one error."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    spec = root / "results/spec/tiny-qwen3.5.json"
    sweep = json.loads((root / "results/demo/tiny-qwen3.5_sweep.json").read_text())
    sweep["model"] = json.loads(spec.read_text())["config"]["model"]
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    args = ["recommend", tmp_path / "sweep.json", "--kl-budget", "1e-3", "--spec", spec]
    code, text = invoke(args + ["--min-accept", 0.9])
    assert code == 0, text
    assert "recommended s16_sr@L16" in text, text      # tp8_hi16_sr@L16 without the constraint
    left = text[text.index("not considered (below --min-accept 0.9"):]
    assert "tp8_hi16_sr@L16 (0.89)" in left and "tp8_hi16_sr@L8 (not measured)" in left
    code, text = invoke(args + ["--min-accept", 1.5])
    assert code == 1 and "no variant" in text and "f4_sr_rs@L16 0.99" in text, text
    one_clear_error(*invoke(args), "--spec and --min-accept go together")
    one_clear_error(*invoke(args + ["--min-accept", -1]), "--min-accept must be a number >= 0")
    code, text = invoke(["recommend", root / "results/demo/tiny-qwen3.5_sweep.json", "--kl-budget",
                         "1e-3", "--spec", spec, "--min-accept", 0.5])
    one_clear_error(code, text, "give a spec run of the sweep's model")


def test_an_assistant_of_recurrent_layers_only_is_one_error(tmp_path):
    """HF asks an assistant's cache for its length through an attention layer: a Mamba-2-only
    assistant (tiny-mamba2) is refused before any decode, naming why."""
    code, text = invoke(ARGS + ["--assistant", "tiny-mamba2", "--out", tmp_path / "a.json"])
    one_clear_error(code, text, "--assistant tiny-mamba2: every layer is recurrent",
                    "get_seq_length")
    assert not (tmp_path / "a.json").exists()
