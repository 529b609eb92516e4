"""`replayquant bench merge`: one kernels table from several `bench kernels` runs of one commit
on one device kind (the grid split over calls of at most ten minutes)."""

from __future__ import annotations

import json
from pathlib import Path

from replayquant.bench.kernels.render import plot_kernels, render_markdown
from replayquant.bench.kernels.table import KERNELS_KIND, check_kernels_out, derive_speedups
from replayquant.bench.targets import targets
from replayquant.outputs import output_lock, write_json, write_text
from replayquant.provenance import provenance

# the grid's lists in a provenance: the merged one lists what any part ran
_LISTED = ("batches", "L", "pairs", "T", "spec_batches")


def one_commit(commits) -> str | None:
    """The commit of parts that name one commit, some perhaps abbreviated (a device run is told
    its commit by REPLAYQUANT_GIT_COMMIT, full or short): the longest name, which every other
    starts with. Parts of different commits are an error."""
    names = sorted({str(c) for c in commits}, key=len)
    full = names[-1]
    if any(len(c) < 7 or not full.startswith(c) for c in names[:-1]):
        raise ValueError(f"bench merge: the parts differ in git_commit ({names}); merge only "
                         "runs of one commit on one device kind")
    return None if full == "None" else full


def merge_kernels(parts, out: str = "build/bench", name: str = "kernels",
                  plot: bool = True) -> dict:
    """`_merge_kernels` into the folder `out`, its NAME.json checked first (`check_kernels_out`:
    never one of the parts) and locked from the checks to the last write."""
    path = check_kernels_out(out, name, "replayquant bench merge", inputs=parts)
    with output_lock(path):
        check_kernels_out(out, name, "replayquant bench merge", inputs=parts)
        return _merge_kernels(parts, out, name, plot)


def _merge_kernels(parts, out: str = "build/bench", name: str = "kernels",
                   plot: bool = True) -> dict:
    """`replayquant bench merge`: one {name}.json / .md / _speedup.png from several `bench
    kernels` runs of one commit on one device kind (the grid split over calls of at most ten
    minutes). Speedups are derived within each part (a part is one call, perhaps one machine:
    split the grid by layer kind so that a kind's conventional and replay rows share a part);
    targets come from the merged rows; a section skipped by one part and run by
    another is not listed as skipped. Each row names its part; the provenance lists the parts."""
    runs = _read_parts(parts)
    commit = one_commit([r["provenance"].get("git_commit") for r in runs])
    ran = _check_parts(parts, runs)
    res = _merged(parts, runs, commit, ran)
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    md = render_markdown(res)
    write_text(outp / f"{name}.md", md)
    if plot:
        plot_kernels(res, str(outp / f"{name}_speedup.png"))
    write_json(outp / f"{name}.json", res, default=str)
    return res


def _read_parts(parts) -> list:
    """The parts' JSON, each checked to be a `bench kernels` result."""
    if len(parts) < 2:
        raise ValueError("bench merge needs at least two kernels JSON files (parts of one run)")
    runs = []
    for p in parts:
        try:
            runs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"bench merge: cannot read {p} as JSON ({e})") from None
        if "rows" not in runs[-1] or "provenance" not in runs[-1]:
            raise ValueError(f"bench merge: {p} is not a `bench kernels` result (no rows / "
                             "provenance)")
    return runs


def _check_parts(parts, runs) -> dict:
    """One device and smoke_cpu across the parts, and no section run by two: {section: part}."""
    for key in ("device", "smoke_cpu"):
        vals = {str(r["provenance"].get(key)) for r in runs}
        if len(vals) > 1:
            raise ValueError(f"bench merge: the parts differ in {key} ({sorted(vals)}); merge "
                             "only runs of one commit on one device kind")
    ran = {}
    for i, r in enumerate(runs):
        for sec in r.get("section_s", {}):
            if sec in ran:
                raise ValueError(f"bench merge: section {sec} ran in both {parts[ran[sec]]} and "
                                 f"{parts[i]}; merge parts that split the grid")
            ran[sec] = i
    return ran


def _merged(parts, runs, commit, ran) -> dict:
    """The merged table: the parts' rows (each naming its part, speedups derived within it),
    errors, configs, sections skipped by every part, the first part's checks, peer comparison
    and accuracy; the provenance of part 0 with the grid lists joined and the parts listed."""
    rows, errors, configs, skipped = [], {}, {}, []
    pv = dict(runs[0]["provenance"], git_commit=commit)
    for k in _LISTED:
        pv[k] = sorted({x for r in runs for x in r["provenance"].get(k, [])})
    pv["shapes"] = {k: v for r in runs for k, v in r["provenance"].get("shapes", {}).items()}
    pv["parts"] = []
    res = {"kind": KERNELS_KIND, "provenance": pv, "rows": rows, "errors": errors,
           "skipped": skipped}
    for i, r in enumerate(runs):
        part_rows = [{**row, "part": i} for row in r["rows"]]
        derive_speedups(part_rows)
        rows += part_rows
        errors.update({f"part {i}: {k}": v for k, v in r.get("errors", {}).items()})
        configs.update(r.get("configs") or {})
        skipped += [k for k in r.get("skipped", []) if k.split(" ")[0] not in ran]
        for k in ("checks", "peer_comparison", "accuracy"):
            if r.get(k) is not None and k not in res:
                res[k] = r[k]
        q = r["provenance"]
        pv["parts"].append(dict(file=str(parts[i]), date=q.get("date"), wall_s=r.get("wall_s"),
                                copy_GBps=r.get("copy_GBps"), host=q.get("host"),
                                **{k: q.get(k) for k in (*_LISTED, "checks", "peers", "sweep")},
                                kinds=sorted(q.get("shapes", {}))))
    bws = [r["copy_GBps"] for r in runs if r.get("copy_GBps")]
    res["copy_GBps"] = sum(bws) / len(bws) if bws else None
    res["copy_GBps_parts"] = [r.get("copy_GBps") for r in runs]
    res["configs"] = configs
    me = provenance("cpu")
    pv["merged"] = dict(by="replayquant bench merge", date=me.get("date"),
                        git_commit=me.get("git_commit"))
    res["targets"] = targets(res)
    res["wall_s"] = sum(r.get("wall_s") or 0 for r in runs)
    return res
