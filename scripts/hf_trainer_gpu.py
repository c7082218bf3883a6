"""A ~1B Llama trained with Hugging Face ``Trainer`` on one GPU, with AdamW and with matrixopt's Muon: tokens/s of
each, their ratio, peak memory and the training losses, written as JSON.

    python scripts/hf_trainer_gpu.py --out runs/hf_trainer                         # 1b preset, ~3 minutes on an H100
    python scripts/hf_trainer_gpu.py --out runs/hf_tiny --preset tiny --device cpu --steps 3 --warmup 1 \
        --batch 2 --seq 64 --accum 1                                               # smoke test

Both runs see the same batches: windows of ``--seq`` tokens from ``--data`` (GPT-2 BPE ``.u16.xz``, default the
prose file of ``../shared/data``; random tokens where it is missing), in one fixed order. Trainer does what users
run: bf16 autocast over fp32 weights, 8 sequences of 1024 tokens per micro-batch and 4 micro-batches per step
(32k tokens), clipping at 1.0, a cosine schedule with warmup, loss logged every 10 steps.
The AdamW baseline is Trainer's own (``optim="adamw_torch_fused"`` on CUDA); Muon comes from
``matrixopt.integrations.hf.create_optimizer``. Tokens/s counts the steps after ``--warmup`` (Triton compiles and
tunes its kernels in the first steps), between two device syncs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from matrixopt.integrations import hf
from matrixopt.train.data import read_tokens

PRESETS = {  # Llama-style; vocab 50304 holds GPT-2's 50257 ids
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=50304),  # 1.18B parameters, untied head
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=50304),
}


def windows(path: str, n: int, seq: int, seed: int) -> tuple[torch.Tensor, str]:
    """``(n, seq)`` int64 token windows in a fixed random order, and where they came from."""
    g = np.random.default_rng(seed)
    if Path(path).is_file():
        tokens = read_tokens(path)
        starts = g.integers(0, len(tokens) - seq, size=n)
        return torch.from_numpy(np.stack([tokens[s:s + seq].astype(np.int64) for s in starts])), path
    return torch.from_numpy(g.integers(0, 50257, size=(n, seq))), "random tokens (no data file)"


class Rows(torch.utils.data.IterableDataset):
    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __iter__(self):
        for row in self.rows:
            yield {"input_ids": row, "labels": row}


class Timer(transformers.TrainerCallback):
    """Wall-clock of the steps after ``warmup``, between device syncs, and the logged losses."""

    def __init__(self, warmup: int, device: str):
        self.warmup, self.device, self.t0, self.t1, self.losses = warmup, device, None, None, []

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.warmup:
            self._sync()
            self.t0 = time.perf_counter()
        elif state.global_step == state.max_steps:
            self._sync()
            self.t1 = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append((state.global_step, float(logs["loss"])))


def run(name: str, lr: float, rows: torch.Tensor, a: argparse.Namespace) -> dict:
    torch.manual_seed(a.seed)
    config = transformers.LlamaConfig(**PRESETS[a.preset], max_position_embeddings=a.seq, tie_word_embeddings=False)
    with torch.device(a.device):  # initialized where it trains
        model = transformers.LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    cuda = a.device == "cuda"
    args = transformers.TrainingArguments(
        output_dir=str(Path(a.out) / name), per_device_train_batch_size=a.batch, gradient_accumulation_steps=a.accum,
        max_steps=a.warmup + a.steps,
        learning_rate=lr, weight_decay=0.1, adam_beta2=0.95, warmup_steps=a.warmup, lr_scheduler_type="cosine",
        max_grad_norm=1.0, bf16=True, logging_steps=10, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=not cuda, dataloader_num_workers=0, optim="adamw_torch_fused" if cuda else "adamw_torch",
        seed=a.seed)
    timer = Timer(a.warmup, a.device)
    optimizers = (None, None)
    if name != "adamw":
        opts = json.loads(a.muon_opts)
        optimizers = (hf.create_optimizer(model, args, name=name, **opts), None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(rows), optimizers=optimizers,
                                   callbacks=[timer])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t
    seconds = timer.t1 - timer.t0
    tokens = a.steps * a.accum * a.batch * a.seq
    out = dict(optimizer=name, optimizer_class=type(trainer.optimizer.optimizer).__name__, lr=lr,
               params=n_params, timed_steps=a.steps, tokens_per_s=tokens / seconds,
               step_ms=1e3 * seconds / a.steps, wall_s_total=total, losses=timer.losses,
               peak_memory_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else None)
    print(f"{name}: {out['tokens_per_s']:,.0f} tokens/s, {out['step_ms']:.1f} ms/step, last loss "
          f"{timer.losses[-1][1] if timer.losses else float('nan'):.3f}", flush=True)
    del trainer, model, optimizers
    if cuda:
        torch.cuda.empty_cache()
    return out


def steps_to(losses: list, target: float) -> int | None:
    """The first logged step whose loss is at or below ``target``."""
    return next((s for s, v in losses if v <= target), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the JSON (and Trainer's output dirs)")
    p.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    p.add_argument("--data", default="../shared/data/prose_gpt2_train.u16.xz")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8, help="per-device batch size (sequences)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--accum", type=int, default=4, help="gradient accumulation steps per optimizer step")
    p.add_argument("--steps", type=int, default=40, help="timed optimizer steps, after --warmup")
    p.add_argument("--warmup", type=int, default=10, help="untimed first steps (and the lr warmup)")
    p.add_argument("--lr", default="adamw=3e-4,muon=1e-3", help="name=lr,... (the optimizers to run, in order)")
    p.add_argument("--muon-opts", default="{}", help="JSON of extra matrixopt optimizer arguments, e.g. "
                                                     '\'{"adamw_lr": 3e-4, "cuda_graph": true}\'')
    p.add_argument("--seed", type=int, default=1337)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    transformers.logging.set_verbosity_error()
    lrs = {k: float(v) for k, v in (e.split("=") for e in a.lr.split(","))}
    rows, source = windows(a.data, (a.warmup + a.steps) * a.accum * a.batch, a.seq, a.seed)
    runs = [run(name, lr, rows, a) for name, lr in lrs.items()]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = dict(
        env=dict(torch=torch.__version__, transformers=transformers.__version__, commit=commit,
                 device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu"),
        config=dict(preset=a.preset, model=PRESETS[a.preset], batch=a.batch, accum=a.accum, seq=a.seq, steps=a.steps,
                    warmup=a.warmup, data=source, bf16=True, max_grad_norm=1.0, muon_opts=json.loads(a.muon_opts)),
        runs=runs)
    if "adamw" in lrs and len(runs) > 1:
        base = next(r for r in runs if r["optimizer"] == "adamw")
        target = base["losses"][-1][1] if base["losses"] else None
        record["vs_adamw"] = {r["optimizer"]: dict(tokens_per_s_ratio=r["tokens_per_s"] / base["tokens_per_s"],
                                                   steps_to_adamw_final_loss=steps_to(r["losses"], target)
                                                   if target is not None else None)
                              for r in runs if r is not base}
        print(json.dumps(record["vs_adamw"], indent=1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"hf_trainer_{a.preset}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
