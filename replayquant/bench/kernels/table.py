"""The kernels table (NAME.json of `replayquant bench kernels` and `bench merge`): its kind, the
check of the folder it goes to, and the speedups derived from its rows."""

from __future__ import annotations

from pathlib import Path

from replayquant.outputs import check_out_folder, check_owned

KERNELS_KIND = "replayquant.bench.kernels"   # the "kind" of NAME.json of bench kernels / merge


def _is_kernels(old: dict) -> bool:
    """A kernels JSON written before they carried a "kind"."""
    return {"provenance", "rows", "errors", "skipped", "copy_GBps"} <= set(old)


def check_kernels_out(out, name: str, writer: str, inputs=()) -> Path:
    """OUT/NAME.json, checked before any work: OUT is a folder that can be written, and NAME.json
    / .md / _speedup.png there are a kernels table's or absent (`replayquant.outputs.check_owned`;
    `inputs`: the files the command reads, never replaced)."""
    outp = check_out_folder(out, f"{writer} writes {name}.json, {name}.md and {name}_speedup.png")
    path = outp / f"{name}.json"
    check_owned(path, KERNELS_KIND, writer, inputs=inputs, unkinded=_is_kernels,
                beside=(outp / f"{name}.md", outp / f"{name}_speedup.png"))
    return path


# the rows with a speedup over our conventional FP32 step (and the FP32 peer) at the same batch
_VS_CONV = ("conventional", "replay-window", "replay-read-step", "replay-forced-flush",
            "replay-forced-flush-layer", "replay-forced-auto-layer", "replay-window-staggered",
            "authors", "authors-staggered", "sweep/conventional", "sweep/replay-read-step")


def derive_speedups(rows):
    """Speedups over our conventional FP32 step and the peer at the same (kind, B), and of each
    speculative replay round over the snapshot round at the same (kind, B, T)."""
    base = {(r["kind"], r["B"]): r["us"] for r in rows
            if r["kernel"] == "conventional" and r["variant"] == "fp32"}
    peer = {(r["kind"], r["B"], r["variant"]): r["us"] for r in rows
            if r["kernel"] in ("peer:fla", "peer:mamba_ssm")}
    snap = {(r["kind"], r["B"], r.get("T")): r["us"] for r in rows
            if r["kernel"] == "spec-snapshot-round"}
    for r in rows:
        k = (r["kind"], r["B"])
        if r["kernel"] in _VS_CONV and k in base:
            r["speedup_vs_conv_fp32"] = base[k] / r["us"]
            p = peer.get((r["kind"], r["B"], "float32"))
            if p:
                r["speedup_vs_peer_fp32"] = p / r["us"]
        if r["kernel"] == "spec-replay-round" and (*k, r.get("T")) in snap:
            r["speedup_vs_snapshot_round"] = snap[(*k, r.get("T"))] / r["us"]
    return rows
