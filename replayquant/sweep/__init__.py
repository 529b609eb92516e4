"""Which pair and buffer length for model X, what it costs in accuracy and what it buys.

Command line::

    replayquant sweep --model M --pair P [--pair ...] --buffer-len 4,8,16,32 [--dataset ...]
        [--context N] [--docs N] [--kernels results/bench/kernels.json --batch 256] [--out F.json]
    replayquant recommend SWEEP.json --kl-budget 1e-3 [--max-bytes B] [--max-memory B]
        [--gpqa SUMMARY.json --gpqa-budget 1.0]
    replayquant sensitivity --model M --pair P [--pair Q] [--per-pass N] [--out F.json]
    replayquant recommend --per-layer SENSITIVITY.json --kl-budget 1e-3 [--low P --high Q]

* `sweep` (`replayquant.sweep.command`): every (pair, L) of the grid is one variant of one KL
  run (`replayquant kl`'s harness: the FP32-state reference and every variant in lockstep over
  the same documents, the reference computed once, resumable). Per variant it adds the state
  bytes a decode step moves per sequence, summed over the model's recurrent layers (Gated
  DeltaNet, Kimi Delta Attention, Mamba-2: each counted as its kind), and the state memory per
  sequence (`replayquant.statebytes`, the kernels bench's byte model), and with
  `--kernels` the decode-kernel time measured for the same pair and L at the nearest batch
  (`replayquant.sweep.measured`). Writes NAME.json (kind `replayquant.sweep`), NAME.png (KL
  against bytes per step, log-log, Pareto front, the FP32 conventional step as the reference
  point) and the KL run's own files NAME_kl.json, NAME_kl.kl/, NAME_kl.png.
* `recommend` (`replayquant.sweep.recommend`): the variant with the fewest state bytes per step
  whose KL upper bound (mean + uncertainty, `kl_bound`) is within the budget.
* `sensitivity` (`replayquant.sweep.sensitivity`): per recurrent layer, the KL when only that
  layer holds the pair (a layer policy with every other layer `exact`), all layers in one
  lockstep pass, ranked; `recommend --per-layer` (`replayquant.sweep.per_layer`) turns it into a
  layer policy and measures it.
"""

from .common import kl_bound, load_json_kind

__all__ = ["kl_bound", "load_json_kind"]
