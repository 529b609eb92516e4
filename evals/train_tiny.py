"""Rebuild the embedded tiny models (issue 8): corpus, tokenizer, one Qwen3.5 and one Mamba-2 model.

Stages (each deterministic from its inputs and --seed):

  prepare   King James Version from Debian's bible-kjv-text .deb (downloaded with `apt-get download`
            if not found) -> split by book -> byte-level BPE tokenizer (4096) -> uint16 token
            streams in DATA_DIR (default .gpu/tiny), and the held-out books as gzip JSONL.
  train     both models on DATA_DIR's token streams (GPU; bf16 autocast), checkpoint with the best
            validation loss (validation books are neither training nor held-out books), weights
            rounded to bf16 for shipping, held-out perplexity of the shipped weights (fp32) at
            contexts 4096 / 8192 / 16384, a loss-curve PNG and a JSON log, all into --out.
  install   copy the model folders from a train output into replayquant/assets/ and the log and
            PNG into results/train_tiny/.

How the shipped models were made (results/train_tiny/train_log.json has the full record):

  python evals/train_tiny.py prepare --heldout-out replayquant/data/kjv_heldout.jsonl.gz
  # on one H200 (device tool, .gpu/tiny carried; torch 2.11, transformers 5.17):
  python evals/train_tiny.py train --data .gpu/tiny --out $OUT --time-budget 110
  python evals/train_tiny.py install --from <the train output>

`--steps auto` (the default) times the first steps and fits each model's step count into
--time-budget; the log records the resolved counts (150 for tiny-qwen3.5, 74 for tiny-mamba2), and
`--steps 150,74` with the same seed reruns exactly that schedule (same data order, same
initialisation; bitwise equality also needs the same GPU and library versions).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import tiny_data  # noqa: E402

MODEL_NAMES = {"qwen": "tiny-qwen3.5", "mamba": "tiny-mamba2"}
ASSETS = ROOT / "replayquant" / "assets"
RESULTS = ROOT / "results" / "train_tiny"


# ------------------------------------------------------------------------------------------ models
def qwen_config(vocab_size: int, eos_id: int):
    """Qwen3.5 architecture, scaled down: 6 Gated DeltaNet layers + 2 gated full-attention layers
    (the 3:1 pattern of Qwen3.5), 2 key / 4 value GDN heads of 64 (each value head a 64x64 state).
    rope_theta 1000: every rotary frequency completes a period inside the 4K training context, so
    8K-16K contexts see no unseen rotation angles."""
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=384, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
        + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=131072, tie_word_embeddings=True, use_cache=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)


def mamba_config(vocab_size: int, eos_id: int):
    """Mamba-2, scaled down: 8 layers, d_model 256, expand 2, 8 heads of 64, d_state 64, 1 group
    (each head a 64x64 state). initializer_range 0.02 (HF's default 0.1 starts the tied output
    layer far above ln(vocab))."""
    from transformers import Mamba2Config
    return Mamba2Config(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=8, expand=2, head_dim=64,
        num_heads=8, state_size=64, n_groups=1, conv_kernel=4, chunk_size=64,
        initializer_range=0.02, tie_word_embeddings=True, use_cache=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)


def build_model(kind: str, vocab_size: int, eos_id: int):
    from transformers import Mamba2ForCausalLM, Qwen3_5ForCausalLM
    if kind == "qwen":
        return Qwen3_5ForCausalLM(qwen_config(vocab_size, eos_id))
    if kind == "mamba":
        return Mamba2ForCausalLM(mamba_config(vocab_size, eos_id))
    raise ValueError(f"unknown model kind {kind!r}: use 'qwen' or 'mamba'")


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------- train
def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def token_loss(model, ids, autocast: bool):
    """Mean next-token cross entropy (fp32) of a [B, T] batch; also per-position losses."""
    import torch
    import torch.nn.functional as F
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                          reduction="none").view(ids.shape[0], -1)
    return nll


def eval_stream(model, tokens: np.ndarray, ctx: int, device, autocast: bool) -> float:
    """Mean NLL over the non-overlapping windows of ctx+1 tokens of one stream, in one batch."""
    import torch
    model.eval()
    n = (len(tokens) - 1) // ctx
    batch = np.stack([tokens[w * ctx:w * ctx + ctx + 1] for w in range(n)]).astype(np.int64)
    with torch.no_grad():
        nll = token_loss(model, torch.from_numpy(batch).to(device), autocast)
    model.train()
    return float(nll.mean())


BUCKETS = [0, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768]


def eval_heldout(model, docs_tokens: list[np.ndarray], eos_id: int, ctx: int, device,
                 batch: int = 8) -> dict:
    """Held-out perplexity at context `ctx`: every book is [EOS] + its tokens, cut into consecutive
    windows of ctx tokens (each from a fresh state); every token after a window's first is scored.
    fp32, no autocast (as the shipped weights run on a CPU). Also the mean NLL by position in the
    window (log-spaced buckets), which shows whether the model uses long context."""
    import torch
    model.eval()
    windows = []
    for doc in docs_tokens:
        seq = np.concatenate([[eos_id], doc]).astype(np.int64)
        windows += [seq[s:s + ctx] for s in range(0, len(seq) - 1, ctx) if len(seq[s:s + ctx]) >= 2]
    total, count = 0.0, 0
    nb = len(BUCKETS) - 1
    bsum, bcnt = np.zeros(nb), np.zeros(nb)
    bucket_of = np.searchsorted(BUCKETS, np.arange(1, ctx), side="right") - 1
    by_len: dict[int, list[np.ndarray]] = {}
    for w in windows:
        by_len.setdefault(len(w), []).append(w)
    with torch.no_grad():
        for length in sorted(by_len):
            group = by_len[length]
            for i in range(0, len(group), batch):
                ids = torch.from_numpy(np.stack(group[i:i + batch])).to(device)
                nll = token_loss(model, ids, autocast=False).double().cpu().numpy()
                total += nll.sum()
                count += nll.size
                per_pos = nll.sum(0)
                np.add.at(bsum, bucket_of[:length - 1], per_pos)
                np.add.at(bcnt, bucket_of[:length - 1], nll.shape[0])
    model.train()
    mean = total / count
    return {"context": ctx, "windows": len(windows), "tokens_scored": int(count),
            "nll": round(float(mean), 5), "ppl": round(math.exp(mean), 3),
            "nll_by_position": {f"{BUCKETS[b]}-{BUCKETS[b + 1]}": round(float(bsum[b] / bcnt[b]), 4)
                                for b in range(nb) if bcnt[b] > 0}}


def train_one(kind: str, data: Path, out: Path, args, steps: str = "auto") -> dict:
    import torch
    device = torch.device(args.device)
    meta = json.loads((data / "corpus.json").read_text())
    vocab, eos_id = meta["vocab_size"], meta["eos_id"]
    train = np.load(data / "train.npy")
    val = np.load(data / "val.npy")
    heldout = np.load(data / "heldout.npy")
    docs = json.loads((data / "heldout_docs.json").read_text())
    # heldout.npy is [EOS doc0 EOS doc1 ...]: recover each book's tokens
    heldout_docs, pos = [], 0
    for d in docs:
        assert heldout[pos] == eos_id
        heldout_docs.append(heldout[pos + 1:pos + 1 + d["tokens"]])
        pos += 1 + d["tokens"]
    if args.heldout_limit:
        heldout_docs = [d[:args.heldout_limit] for d in heldout_docs]

    torch.manual_seed(args.seed)
    np_rng = np.random.default_rng(args.seed)
    model = build_model(kind, vocab, eos_id).to(device)
    model.config.use_cache = False
    model.train()
    nparam = n_params(model)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    T, B = args.seq_len, args.batch
    autocast = device.type == "cuda"
    name = MODEL_NAMES[kind]
    print(f"[{name}] {nparam / 1e6:.3f}M parameters, batch {B} x {T}, device {device}", flush=True)

    total = None if steps == "auto" else int(steps)
    probe = 6                     # steps timed to resolve --steps auto (warmup is longer than this)
    losses, val_curve = [], []
    best = (float("inf"), -1, None)
    t0 = time.time()
    t_probe = None
    step = 0
    pending = []
    stopped_early = None
    while total is None or step < total:
        starts = np_rng.integers(0, len(train) - T - 1, size=B)
        batch = np.stack([train[s:s + T + 1] for s in starts]).astype(np.int64)
        ids = torch.from_numpy(batch).to(device, non_blocking=True)
        lr = lr_at(step, total or 10 ** 9, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = token_loss(model, ids, autocast).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        pending.append(loss.detach())
        step += 1
        if step == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_probe = time.time()
        if total is None and step == probe:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_probe) / (probe - 2)
            # evaluation every eval_every steps costs about one step each time
            total = int(min(args.max_steps, max(probe + 1, args.time_budget / (per_step * 1.06))))
            print(f"[{name}] {per_step:.3f} s/step -> {total} steps for {args.time_budget:.0f} s",
                  flush=True)
        if total is not None and step < total and time.time() - t0 > 1.5 * args.time_budget:
            print(f"[{name}] over 1.5x the time budget at step {step}: stopping here", flush=True)
            stopped_early = step
            total = step
        if len(pending) >= 10 or (total is not None and step >= total):
            losses += [round(float(x), 4) for x in torch.stack(pending).cpu()]
            pending = []
        if total is not None and (step % args.eval_every == 0 or step >= total):
            vloss = eval_stream(model, val, T, device, autocast)
            val_curve.append((step, round(vloss, 4)))
            print(f"[{name}] step {step}/{total} lr {lr:.2e} train {float(loss.detach()):.4f} "
                  f"val {vloss:.4f} ({time.time() - t0:.0f} s)", flush=True)
            if vloss < best[0]:
                best = (vloss, step, {k: v.detach().to("cpu", copy=True)
                                      for k, v in model.state_dict().items()})
    train_time = time.time() - t0
    model.load_state_dict(best[2])

    # Ship bf16-rounded weights; compute in fp32 (config dtype float32 -> from_pretrained loads fp32)
    round_params_bf16(model)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t1 = time.time()
    evals = [eval_heldout(model, heldout_docs, eos_id, ctx, device) for ctx in args.eval_contexts]
    for e in evals:
        print(f"[{name}] held-out ppl @ ctx {e['context']}: {e['ppl']}  by position "
              f"{e['nll_by_position']}", flush=True)
    eval_time = time.time() - t1

    folder = out / "_build" / name              # tarred below: the device returns at most 8 files
    save_model_folder(model, folder, data / "tokenizer")
    tokens_seen = total * B * T
    return {
        "name": name, "architecture": type(model).__name__, "parameters": nparam,
        "config": json.loads((folder / "config.json").read_text()),
        "seed": args.seed, "seq_len": T, "batch": B, "steps": total, "steps_arg": steps,
        "stopped_early_at": stopped_early, "tokens_seen": tokens_seen, "epochs": round(tokens_seen / len(train), 2),
        "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
        "optimizer": "AdamW(0.9, 0.95), cosine to 10%, grad clip 1.0, bf16 autocast",
        "train_seconds": round(train_time, 1), "seconds_per_step": round(train_time / total, 4), "eval_seconds": round(eval_time, 1),
        "best_val": {"step": best[1], "nll": round(best[0], 4), "ppl": round(math.exp(best[0]), 3)},
        "train_loss": losses, "val_curve": val_curve, "heldout": evals,
        "safetensors_bytes": (folder / "model.safetensors").stat().st_size,
    }


def round_params_bf16(model) -> None:
    """Round every parameter to bf16 in place, keeping fp32 storage (buffers such as RoPE's
    inv_freq stay exact: they are computed from the config, not shipped)."""
    import torch
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def save_model_folder(model, folder: Path, tokenizer_dir: Path) -> None:
    """HF folder: bf16 safetensors (the parameters, already bf16-exact), config with dtype float32
    (from_pretrained loads and computes in fp32 by default), generation config, tokenizer files."""
    import torch
    folder.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    sd = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")                  # tied to the input embedding: stored once
    model.save_pretrained(str(folder), state_dict=sd)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in sorted(tokenizer_dir.iterdir()):
        shutil.copy(f, folder / f.name)


def plot_losses(logs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for lg, c in zip(logs, ["tab:blue", "tab:orange"]):
        y = np.array(lg["train_loss"])
        k = min(10, len(y))
        smooth = np.convolve(y, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, len(y) + 1), smooth, color=c, lw=1.2,
                label=f"{lg['name']} train ({lg['parameters'] / 1e6:.1f}M params)")
        vs, vl = zip(*lg["val_curve"])
        ax.plot(vs, vl, "o--", color=c, ms=3, lw=0.8, label=f"{lg['name']} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_ylim(bottom=min(min(lg["train_loss"]) for lg in logs) - 0.2, top=6.0)
    ax.set_title("Tiny models on the KJV (4096-token BPE, 4K context)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def device_is_cuda(args) -> bool:
    return str(args.device).startswith("cuda")


def cmd_train(args) -> None:
    import torch
    from replayquant.provenance import provenance
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data)
    if not (data / "corpus.json").is_file():
        raise SystemExit(f"{data} has no corpus.json: run `python evals/train_tiny.py prepare` first")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        import torch.utils.deterministic
        torch.utils.deterministic.fill_uninitialized_memory = False   # no extra fill kernels
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()
    logs, errors = [], []
    kinds = args.models.split(",")
    steps = args.steps.split(",")
    if len(steps) == 1:
        steps = steps * len(kinds)
    if len(steps) != len(kinds) or not all(x == "auto" or x.isdigit() for x in steps):
        raise SystemExit(f"--steps {args.steps!r}: give 'auto', one number, or one per model "
                         f"({len(kinds)}: {args.models})")
    for kind, nsteps in zip(kinds, steps):
        try:
            logs.append(train_one(kind, data, out, args, nsteps))
        except Exception as e:                 # keep the other model's run: one device call only
            import traceback
            traceback.print_exc()
            errors.append({"model": kind, "error": repr(e), "traceback": traceback.format_exc()})
            if device_is_cuda(args):
                torch.cuda.empty_cache()
    for lg in logs:                            # tar each model folder: the device returns <= 8 files
        with tarfile.open(out / f"{lg['name']}.tar", "w") as tf:
            tf.add(out / "_build" / lg["name"], arcname=lg["name"])
    shutil.rmtree(out / "_build", ignore_errors=True)
    if logs:
        plot_losses(logs, out / "loss_curve.png")
    log = {"provenance": provenance(device=args.device, command=" ".join(sys.argv),
                                    source_commit=args.source_commit,
                                    wall_seconds=round(time.time() - t0, 1)),
           "corpus": json.loads((data / "corpus.json").read_text()),
           "models": logs, "errors": errors}
    log["corpus"]["source"].pop("copyright", None)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    print("\nmodel            params   steps  train s  best val ppl  " +
          "  ".join(f"held-out ppl@{c}" for c in args.eval_contexts))
    for lg in logs:
        print(f"{lg['name']:<16} {lg['parameters'] / 1e6:5.2f}M  {lg['steps']:5d}  "
              f"{lg['train_seconds']:7.1f}  {lg['best_val']['ppl']:12.2f}  " +
              "  ".join(f"{e['ppl']:15.2f}" for e in lg["heldout"]))


def cmd_prepare(args) -> None:
    meta = tiny_data.prepare(args.data, deb=args.deb, cache_dir=args.cache,
                             vocab_size=args.vocab_size, heldout_out=args.heldout_out)
    s = meta["split"]
    print(f"tokenizer: vocab {meta['vocab_size']}; tokens train {s['train']['tokens']}, "
          f"val {s['val']['tokens']}, held-out {s['heldout']['tokens']} ({', '.join(s['heldout']['books'])})")


def cmd_install(args) -> None:
    src = Path(args.src)
    for name in MODEL_NAMES.values():
        tar = src / f"{name}.tar"
        if not tar.is_file():
            raise SystemExit(f"{tar} is missing")
        dest = ASSETS / name
        if dest.exists():
            shutil.rmtree(dest)
        ASSETS.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tar) as tf:
            names = tf.getnames()
            if any(n.startswith(("/", "..")) or "/../" in n or n.split("/")[0] != name for n in names):
                raise SystemExit(f"{tar}: unexpected member paths")
            tf.extractall(ASSETS)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for f in ("train_log.json", "loss_curve.png", "train_stdout.txt"):
        if (src / f).is_file():
            shutil.copy(src / f, RESULTS / f)
    print(f"installed into {ASSETS} and {RESULTS}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="corpus, split, tokenizer, token streams")
    p.add_argument("--data", default=str(ROOT / ".gpu" / "tiny"))
    p.add_argument("--deb", default=None, help="path to bible-kjv-text_4.38_all.deb")
    p.add_argument("--cache", default=None, help="where to look for / download the .deb")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--heldout-out", default=None, help="also write the held-out books (jsonl.gz)")
    t = sub.add_parser("train", help="train both models (GPU)")
    t.add_argument("--data", default=str(ROOT / ".gpu" / "tiny"))
    t.add_argument("--out", required=True)
    t.add_argument("--models", default="qwen,mamba")
    t.add_argument("--device", default="cuda")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--seq-len", type=int, default=4096)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--steps", default="auto",
                   help="'auto' (fit --time-budget), a number, or one per model (e.g. 150,74)")
    t.add_argument("--max-steps", type=int, default=3000)
    t.add_argument("--time-budget", type=float, default=110.0, help="seconds of training per model")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--eval-every", type=int, default=25)
    t.add_argument("--eval-contexts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4096, 8192, 16384])
    t.add_argument("--source-commit", default=None,
                   help="commit of the code (where the device's copy has no .git)")
    t.add_argument("--heldout-limit", type=int, default=0,
                   help="score only the first N tokens of each held-out book (smoke tests)")
    t.add_argument("--deterministic", action="store_true", default=True)
    i = sub.add_parser("install", help="copy a train output into the package and results/")
    i.add_argument("--from", dest="src", required=True)
    args = ap.parse_args(argv)
    {"prepare": cmd_prepare, "train": cmd_train, "install": cmd_install}[args.cmd](args)


if __name__ == "__main__":
    main()
