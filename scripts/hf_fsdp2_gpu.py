"""Hugging Face ``Trainer`` under Accelerate's FSDP2 with matrixopt's Muon (``ShardedMuon`` on the DTensor shards)
against one process: the same losses to rtol 1e-4. Accelerate runs FSDP only on accelerators, so this needs GPUs.

    python scripts/hf_fsdp2_gpu.py --out runs/hf_fsdp2                              # 1 GPU: writes losses_1.json
    torchrun --nproc-per-node 2 scripts/hf_fsdp2_gpu.py --out runs/hf_fsdp2         # 2 GPUs: losses_2.json, compared

A small Llama in fp32 (no autocast, so the two runs differ only by the order of float sums), 8 steps of a global
batch of 8 sequences: each of N ranks takes 8 / N rows of every batch, and the logged loss is the mean over ranks.
Writes ``losses_N.json``; with N > 1 it compares with ``losses_1.json`` and writes ``compare.json`` (exit 1 if the
losses differ by more than rtol 1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from matrixopt.integrations import hf

RTOL = 1e-4
STEPS, BATCH, SEQ = 8, 8, 64


class Rows(torch.utils.data.IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        for row in self.rows:
            yield {"input_ids": row, "labels": row}


class Recording(transformers.Trainer):
    """Keeps each step's loss averaged over the ranks."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.losses = []

    def training_step(self, *a, **k):
        loss = super().training_step(*a, **k)
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        self.losses.append(mean.item())
        return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not torch.cuda.is_available():
        sys.exit("FSDP2 under Trainer needs GPUs: Accelerate runs FSDP only on accelerators (on CPU, Trainer raises "
                 "'Using fsdp only works in distributed training.', or with use_cpu=True falls back to DDP)")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=512,
                                      max_position_embeddings=SEQ)
    model = transformers.LlamaForCausalLM(config)
    rows = torch.randint(0, 512, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    fsdp = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2}) if world > 1 else {}
    args = transformers.TrainingArguments(
        output_dir=str(Path(a.out) / f"trainer_{world}"), per_device_train_batch_size=BATCH // world,
        max_steps=STEPS, learning_rate=3e-3, weight_decay=0.1, max_grad_norm=1.0, report_to=[],
        save_strategy="no", disable_tqdm=True, seed=0, **fsdp)
    trainer = Recording(model=model, args=args, train_dataset=Rows(rows),
                        optimizer_cls_and_kwargs=hf.optimizer_cls_and_kwargs(args, name="muon"))
    trainer.train()
    if int(os.environ.get("RANK", 0)) != 0:
        return
    opt = type(trainer.optimizer.optimizer).__name__
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"losses_{world}.json").write_text(json.dumps(dict(world=world, optimizer=opt, losses=trainer.losses,
                                                              torch=torch.__version__,
                                                              transformers=transformers.__version__)))
    print(f"{world} rank(s), {opt}: {trainer.losses}")
    one = out / "losses_1.json"
    if world > 1 and one.exists():
        ref = json.loads(one.read_text())["losses"]
        rel = max(abs(x - y) / abs(y) for x, y in zip(trainer.losses, ref))
        ok = rel <= RTOL and opt.startswith("Sharded")
        (out / "compare.json").write_text(json.dumps(dict(max_rel_diff=rel, rtol=RTOL, optimizer=opt, ok=ok)))
        print(f"max relative difference from 1 process: {rel:.2e} ({'ok' if ok else 'FAILED'})")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
