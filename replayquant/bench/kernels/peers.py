"""The peer decode kernels beside ours (fla's fused recurrent GDN and KDA steps, mamba_ssm's
selective_state_update) on our inputs: their rows of the table, their outputs against our
conventional FP32 step, and their versions. Both packages are optional: a peer that does not
import is reported as the section's error."""

from __future__ import annotations

from pathlib import Path

import torch

from replayquant.testing import random_state
from replayquant.bench.kernels.grid import PEERS, SHAPES, kernel_fns, kernel_inputs
from replayquant.bench.kernels.timing import empty_cache, graph_ms, plain_ms, rotations, timed_row
from replayquant.replay.stores import ConventionalStore
from replayquant.statebytes import io_bytes


def mamba_ssm_commit():
    """The state-spaces/mamba commit of the importable mamba_ssm: a COMMIT file at the top of the
    package (the device carries only its selective_state_update modules), else its version."""
    try:
        import mamba_ssm        # mamba_ssm: optional
    except Exception:  # noqa: BLE001 (peers are optional)
        return None
    f = Path(mamba_ssm.__file__).parent / "COMMIT"
    return f.read_text().strip() if f.is_file() else getattr(mamba_ssm, "__version__", "?")


def peer_versions(versions: dict) -> None:
    """Into `versions` (a provenance's): fla's version, when it imports, and mamba_ssm_commit."""
    try:
        import fla              # fla: optional
        versions["fla"] = getattr(fla, "__version__", "?")
    except Exception:  # noqa: BLE001
        pass
    versions["mamba_ssm"] = mamba_ssm_commit()


def peer_call(kind, S, kw, state):
    """One decode step of the peer kernel on our inputs (state layout [B, H, d_v, d_k])."""
    if kind == "gdn":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule  # fla: optional
        o, fs = fused_recurrent_gated_delta_rule(
            kw["q"].unsqueeze(1), kw["k"].unsqueeze(1), kw["v"].unsqueeze(1),
            g=kw["a"].unsqueeze(1), beta=kw["b"].unsqueeze(1),
            scale=S["dk"] ** -0.5, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=kw["A_log"],
            dt_bias=kw["dt_bias"], use_beta_sigmoid_in_kernel=True, state_v_first=True)
        return o[:, 0], fs
    if kind == "kda":       # the layer's call: log decay g and beta after the gate and sigmoid
        from fla.ops.kda import fused_recurrent_kda             # fla: optional
        o, fs = fused_recurrent_kda(kw["q"].unsqueeze(1), kw["k"].unsqueeze(1),
                                    kw["v"].unsqueeze(1), g=kw["g"].unsqueeze(1),
                                    beta=kw["beta"].unsqueeze(1), scale=S["dk"] ** -0.5,
                                    initial_state=state, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, state_v_first=True)
        return o[:, 0], fs
    # mamba_ssm: optional
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    B, H, P = kw["x"].shape
    N = S["dk"]
    y = selective_state_update(
        state, kw["x"], kw["dt"].unsqueeze(-1).expand(B, H, P),
        kw["A"][:, None, None].expand(H, P, N), kw["B"], kw["C"], D=kw["D"][:, None].expand(H, P),
        z=kw["z"], dt_bias=kw["dt_bias"][:, None].expand(H, P), dt_softplus=True)
    return y, state


def peer_comparison(device="cuda", shapes=None) -> dict:
    """Our conventional FP32 step vs the peer on identical inputs: max abs difference, for each
    kind of `shapes` (default SHAPES)."""
    out = {}
    B = 32
    for kind, S in (shapes or SHAPES).items():
        try:
            f = kernel_fns(kind)
            init = random_state(B, S["H"], S["dv"], S["dk"], seed=4, device=device)
            kw = kernel_inputs(kind, S, B, seed=5, device=device)
            cs = ConventionalStore.from_state(init, "fp32")
            y = f["conv"](cs, **kw)
            peer_state = init.clone()
            yp, sp = peer_call(kind, S, kw, peer_state)
            out[kind] = {"peer": PEERS[kind][1],
                         "max_abs_y": float((y - yp.float()).abs().max()),
                         "max_abs_y_ref_scale": float(y.abs().max()),
                         "peer_out_dtype": str(yp.dtype),
                         "max_abs_state": float((cs.state.payload - sp.float()).abs().max()),
                         "state_scale": float(sp.float().abs().max())}
        except Exception as e:  # noqa: BLE001 (peers are optional)
            out[kind] = {"error": f"{type(e).__name__}: {e}"}
    return out


def bench_peers(kind, B, device, copy_bw, S=None):
    """Peer kernels (fla / mamba_ssm) on our inputs, FP32 and BF16 states: in a graph with the
    states rotated (cold L2, as our rows), and FP32 without a graph on one state."""
    S = S or SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    init = random_state(B, H, dv, dk, seed=B, device=device)
    kw = kernel_inputs(kind, S, B, seed=1, device=device)
    rows = []
    label = PEERS[kind][0]
    for sd in (torch.float32, torch.bfloat16):
        name = str(sd).split(".")[-1]
        esz = torch.finfo(sd).bits // 8
        io = B * H * io_bytes(kind, H, HK, dv, dk)
        if label == "peer:fla":   # fla reads the state in its dtype and writes a new fp32 state
            nb = B * H * dv * dk * (esz + 4) + io
        else:
            nb = 2 * B * H * dv * dk * esz + io
        R = rotations(B * H * dv * dk * esz, device)
        states = [init.to(sd) for _ in range(R)]
        ms = graph_ms(lambda: [peer_call(kind, S, kw, st) for st in states], 8) / R
        rows.append(timed_row(kind, label, name, B, ms, nb, copy_bw, rot=R))
        if sd == torch.float32:
            ms = plain_ms(lambda: peer_call(kind, S, kw, states[0]))
            rows.append(timed_row(kind, label + "(no graph)", name, B, ms, nb, copy_bw))
        del states
    del init
    empty_cache()
    return rows
