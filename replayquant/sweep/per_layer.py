"""`replayquant recommend --per-layer`: a layer policy built from a sensitivity run, measured.

From a sensitivity run (`recommend --per-layer SENSITIVITY.json --kl-budget B`): every layer
starts with the cheaper pair (`--low`); layers move to the other pair (`--high`) in the order of
how much KL that takes off (single-layer KL of low minus high, largest first) until the
predicted KL fits. The prediction adds the single-layer figures (mean, and upper bounds for the
budget), which assumes the layers' errors add; the sensitivity file's `sum_vs_all` shows how
well that held for one pair on every layer. The policy is then measured with the KL harness on
the same documents and settings as the sensitivity run, and the measurement is reported beside
the prediction; a measured upper bound over the budget is reported as such (exit 1 on the
command line). The sensitivity file must be complete and whole (`check_sensitivity`), the
single-layer KLs of the two pairs finite and not below zero, the model its KL options name the
one it measured (`check_same_model`: every byte of a local folder) and the documents those
options give the ones it measured (`check_same_data`: the sha256 of their tokens; a local dataset
is recorded by its absolute path, so the working folder does not matter).
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from replayquant import statebytes as sb
from replayquant.kl.plot import plot_results_file
from replayquant.kl.settings import KLSettings
from replayquant.outputs import check_out_given, check_owned, output_lock, write_text
from replayquant.pairs import PrecisionPair
from replayquant.policy import LayerPolicy, Override
from replayquant.provenance import describe_model, model_identity, model_mismatch, provenance
from replayquant.statebytes import LayerShape, layer_step_bytes

from .command import variant_costs
from .common import (check_budget, check_results_out, fmt_bytes, kl_figures, kl_file_for,
                     kl_problem, load_json_kind, write_json)
from .recommend import NoFit, check_sensitivity
from .sensitivity import SENS_KIND

__all__ = ["build_policy", "recommend_per_layer", "print_per_layer", "check_same_model",
           "PER_LAYER_KIND"]

PER_LAYER_KIND = "replayquant.per_layer_recommendation"


def _pair_costs(sens: dict, name: str):
    rec = next(p for p in sens["pairs"] if p["name"] == name)
    pair = PrecisionPair.from_dict(rec, source=f"pair {name} of the sensitivity file")
    try:
        shapes = [LayerShape.from_dict(s) for s in sens["layers"]]
    except ValueError as e:
        raise ValueError(f"the sensitivity file's layers: {e}; the file is damaged: run "
                         f"`replayquant sensitivity` again") from None
    return pair, {s.index: layer_step_bytes(s, pair).state for s in shapes}


def build_policy(sens: dict, kl_budget: float, low: str | None = None, high: str | None = None,
                 source: str = ""):
    """(LayerPolicy, plan dict) from a sensitivity dict: the cheapest assignment of `low` /
    `high` per layer (most KL removed first) whose predicted KL upper bound fits the budget.
    Raises NoFit when even every layer at `high` is predicted over the budget, ValueError for a
    file it cannot build from (`check_sensitivity`) and for single-layer KLs of `low` or `high`
    that are not finite numbers >= 0 (no sum of them predicts anything)."""
    check_budget("--kl-budget", kl_budget)
    check_sensitivity(sens, source)
    names = list(sens["per_layer"])
    if len(names) < 2:
        raise ValueError(f"the sensitivity file measured one pair ({names[0]}); a layer policy needs "
                         f"two: run `replayquant sensitivity` with --pair LOW --pair HIGH")
    costs = {n: _pair_costs(sens, n) for n in names}
    total = {n: sum(c[1].values()) for n, c in costs.items()}
    if low is None and high is None and len(names) > 2:
        raise ValueError(f"the sensitivity file measured {len(names)} pairs ({', '.join(names)}); "
                         f"choose two with --low and --high")
    low = low or min(names, key=lambda n: total[n])
    high = high or max((n for n in names if n != low), key=lambda n: total[n])
    for flag, n in (("--low", low), ("--high", high)):
        if n not in names:
            raise ValueError(f"{flag} {n}: not measured in the sensitivity file (it has "
                             f"{', '.join(names)})")
    if low == high:
        raise ValueError(f"--low and --high are both {low}; give two different pairs")
    for n in (low, high):
        for r in sens["per_layer"][n]:
            why = kl_problem(r["kl"])
            if why:
                raise ValueError(f"{source or 'the sensitivity file'}: the single-layer KL of {n} "
                                 f"on layer {r['index']} cannot go into a prediction: {why} (a "
                                 f"diverged measurement, or a damaged file); measure it again or "
                                 f"choose other --low / --high pairs")
    lo = {r["index"]: r for r in sens["per_layer"][low]}
    hi = {r["index"]: r for r in sens["per_layer"][high]}
    kl_lo, kl_hi = (sum(r["kl"]["kl_mean"] for r in x.values()) for x in (lo, hi))
    if kl_hi > kl_lo and total[high] < total[low]:        # the two the other way round
        raise ValueError(f"--high {high} does not lower the KL of --low {low}: its single-layer "
                         f"KLs sum to {kl_hi:.3g}, {low}'s to {kl_lo:.3g}, and it moves fewer "
                         f"state bytes per step ({fmt_bytes(total[high])} against "
                         f"{fmt_bytes(total[low])}); give --low {high} --high {low}")
    order = sorted(lo, key=lambda i: -(lo[i]["kl"]["kl_mean"] - hi[i]["kl"]["kl_mean"]))

    def predict(up: set):
        rows = [hi[i] if i in up else lo[i] for i in lo]
        return (sum(r["kl"]["kl_mean"] for r in rows), sum(r["kl"]["kl_upper"] for r in rows))

    up: list[int] = []
    mean, upper = predict(set())
    for i in order:
        if upper <= kl_budget:
            break
        up.append(i)
        mean, upper = predict(set(up))
    if not upper <= kl_budget:
        raise NoFit(f"no layer policy of {low} and {high} is predicted within the KL budget "
                    f"{kl_budget:.3g}: with every layer at {high} the predicted KL upper bound is "
                    f"{upper:.3g} (sum of single-layer upper bounds, mean {mean:.3g}); raise the "
                    f"budget or measure a higher-precision pair as --high")
    low_pair, high_pair = costs[low][0], costs[high][0]
    name = f"{low}+{high}_kl{kl_budget:g}"          # every budget its own name (not 1e-03)
    overrides = (Override(high_pair, tuple(sorted(up)), None),) if up else ()
    policy = LayerPolicy(low_pair, overrides, name,
                         f"{low} on every recurrent layer, {high} on the {len(up)} layer(s) whose "
                         f"single-layer KL it lowers most, for a predicted KL within {kl_budget:.3g}")
    plan = {
        "low": low, "high": high, "order": order, "upgraded": sorted(up),
        "layers": [{"index": i, "name": lo[i]["name"], "pair": high if i in up else low,
                    "kl_single_low": lo[i]["kl"]["kl_mean"], "kl_single_high": hi[i]["kl"]["kl_mean"],
                    "kl_single_upper": (hi[i] if i in up else lo[i])["kl"]["kl_upper"]}
                   for i in lo],
        "predicted": {"kl_mean": mean, "kl_upper": upper,
                      "how": "sum over layers of the single-layer KL of the pair each layer holds "
                             "(upper: sum of the single-layer upper bounds)"},
        "low_all_layers": sens["all_layers"][low], "high_all_layers": sens["all_layers"][high],
    }
    return policy, plan


def check_same_model(sens: dict, source: str = "") -> dict:
    """The KL options of the sensitivity run, checked to name the model the file measured: a
    local folder must hold every byte it fingerprinted (`local_hash`,
    `provenance.local_fingerprint`), or one ValueError names both; a hub model is measured at
    the revision the file recorded (where the run named none)."""
    # transformers: reading results does not load it
    from replayquant.models.names import resolve_model_name
    args = dict(sens["kl_args"])
    rec, src = sens["model"], source or "the sensitivity file"
    try:
        resolved = resolve_model_name(args["model"])
    except ValueError as e:
        raise ValueError(f"{src} measured the model {args['model']!r}, which is not there now "
                         f"({e})") from None
    if rec.get("local_hash") or os.path.isdir(resolved):
        now = model_identity(args["model"])
        why = model_mismatch(rec, now)
        if why:
            raise ValueError(f"{src} measured the model {describe_model(rec)}; {args['model']} "
                             f"now holds another, {describe_model(now)} ({why}): the policy would "
                             f"be measured on a model its sensitivity file did not measure; put "
                             f"that model back, or run `replayquant sensitivity` again on this one")
    elif rec.get("revision") and not args.get("revision"):
        args["revision"] = rec["revision"]
    return args


def check_same_data(sens: dict, source: str = "") -> tuple[str, dict]:
    """(the sensitivity file, its record of the documents it measured) for the KL run of the
    policy (`kl_command`'s same_documents_as: other documents are one error before the weights
    load); a file without that record is one ValueError."""
    src = source or "the sensitivity file"
    data = sens.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("tokens_sha256"), str):
        raise ValueError(f"{src} does not record the documents it measured (no data.tokens_sha256: "
                         f"written by an earlier replayquant), so a policy measured from it could "
                         f"be measured on other documents: run `replayquant sensitivity` again")
    return src, data


def recommend_per_layer(sens_path, kl_budget: float, low: str | None = None,
                        high: str | None = None, out: str | None = None, progress: bool = True,
                        device_map: str | None = None) -> dict | None:
    """Build the policy (build_policy), measure it with the KL harness on the sensitivity run's
    model, documents and settings, and write OUT.json beside the policy (OUT_policy.yaml) and
    the KL run's files (OUT_kl.*). Returns the result dict (None on ranks > 0)."""
    from replayquant.kl.command import kl_command   # transformers: reading results does not load it
    check_out_given(out)
    sens = load_json_kind(sens_path, SENS_KIND, "replayquant sensitivity")
    policy, plan = build_policy(sens, kl_budget, low, high, source=str(sens_path))
    out_path = check_results_out(out if out is not None else Path("build/recommend") /
                                 f"{Path(sens_path).stem}_{policy.name}.json")
    kl_path = kl_file_for(out_path)
    yaml_path = out_path.with_name(out_path.stem + "_policy.yaml")
    _check_policy_out(out_path, yaml_path, kl_path, policy, kl_budget, sens_path)
    # after the outputs' checks: a model's first fingerprint reads all its weights
    args = check_same_model(sens, str(sens_path))
    same_data = check_same_data(sens, str(sens_path))
    model = args.pop("model")
    settings = KLSettings(**args)
    settings.progress = progress
    if device_map is not None:
        settings.device_map = device_map
    res = kl_command(model, [policy], settings, out=str(kl_path), same_documents_as=same_data)
    if res is None:
        return None
    plot_results_file(kl_path, budget=kl_budget)      # the run's plot with the budget drawn
    stats = res["results"][policy.name]
    measured = kl_figures(stats)
    shapes = [sb.LayerShape.from_dict(s) for s in sens["layers"]]
    conv_b, conv_m = sb.model_conventional(shapes)
    costs = {}
    for label, var in (("policy", policy), (plan["low"], _pair_costs(sens, plan["low"])[0]),
                       (plan["high"], _pair_costs(sens, plan["high"])[0])):
        b, m = variant_costs(var, shapes)
        costs[label] = {"bytes_per_step": b.to_dict(), "memory": m.to_dict()}
    costs["fp32_conventional"] = {"bytes_per_step": conv_b.to_dict(), "memory": conv_m.to_dict()}
    result = {
        "kind": PER_LAYER_KIND, "version": 1, "sensitivity": str(sens_path),
        "model": sens["model"], "kl_budget": kl_budget,
        "policy": policy.to_dict(), "policy_file": yaml_path.name, "plan": plan,
        "predicted": plan["predicted"], "measured": measured,
        "measured_fits": kl_problem(measured) is None and measured["kl_upper"] <= kl_budget,
        "measured_over_predicted": (measured["kl_mean"] / plan["predicted"]["kl_mean"]
                                    if plan["predicted"]["kl_mean"] > 0 else None),
        "costs": costs, "kl_results": kl_path.name,
        "provenance": provenance(sensitivity=str(sens_path), kl_budget=kl_budget, low=plan["low"],
                                 high=plan["high"], kl_results=str(kl_path),
                                 kl_git_commit=res.get("provenance", {}).get("git_commit")),
    }
    _write_policy_out(out_path, yaml_path, kl_path, result, policy, sens_path)
    print_per_layer(result)
    # the KL run has named its own files
    Console(stderr=True).print(f"wrote {out_path} and {yaml_path}", soft_wrap=True)
    return result


def print_per_layer(r: dict, console=None) -> None:
    console = console or Console(width=max(Console().width, 124))
    plan, pr, me = r["plan"], r["predicted"], r["measured"]
    c = r["costs"]
    pb, conv = c["policy"]["bytes_per_step"]["state"], c["fp32_conventional"]["bytes_per_step"]["state"]
    hb = c[plan["high"]]["bytes_per_step"]["state"]
    up = plan["upgraded"]
    console.print(f"layer policy {r['policy']['name']}: {plan['high']} on layer(s) "
                  f"{up if up else 'none'}, {plan['low']} on the other "
                  f"{len(plan['layers']) - len(up)}", soft_wrap=True)
    console.print(f"  predicted KL {pr['kl_mean']:.3g} (upper {pr['kl_upper']:.3g}, sum of single-layer "
                  f"KLs); measured {me['kl_mean']:.3g} ± {me['kl_unc']:.2g} (upper "
                  f"{me['kl_upper']:.3g}), {r['measured_over_predicted'] or float('nan'):.2f}x the "
                  f"prediction; budget {r['kl_budget']:.3g}: "
                  + ("met" if r["measured_fits"] else "NOT met by the measurement"), soft_wrap=True)
    console.print(f"  {fmt_bytes(pb)} of state per decode step and sequence: {conv / pb:.2f}x less than "
                  f"the FP32 conventional step ({fmt_bytes(conv)}), {hb / pb:.2f}x less than "
                  f"{plan['high']} on every layer ({fmt_bytes(hb)})", soft_wrap=True)


def _policy_run(policy, kl_budget) -> dict:
    """What makes a per-layer recommendation the same run: the policy and the budget."""
    return {"policy": policy.to_dict(), "kl_budget": kl_budget}


def _check_policy_out(out_path: Path, yaml_path: Path, kl_path: Path, policy, kl_budget,
                      sens_path) -> None:
    """Refuse, before any work, an --out holding anything but this policy's recommendation (and
    a policy YAML there without its recommendation), so the JSON and the YAML always describe
    one policy."""
    check_owned(out_path, PER_LAYER_KIND, "replayquant recommend --per-layer",
                identity=_policy_run(policy, kl_budget),
                recorded=lambda old: {"policy": old["policy"], "kl_budget": old["kl_budget"]},
                inputs=(sens_path,), beside=(yaml_path,),
                fresh=(yaml_path, kl_path, kl_path.with_suffix(".png"),
                       f"{kl_path.with_suffix('.kl')}/"))


def _write_policy_out(out_path: Path, yaml_path: Path, kl_path: Path, result: dict, policy,
                      sens_path) -> None:
    """The recommendation JSON, then its policy YAML (each atomic), holding the output's lock,
    checked again as before the run (another run may have written it since)."""
    with output_lock(out_path):
        _check_policy_out(out_path, yaml_path, kl_path, policy, result["kl_budget"], sens_path)
        write_json(out_path, result)
        write_text(yaml_path, policy.to_yaml())
