"""Single-GPU profiles behind the issue-5 notes (docs/results/bench/README.md). Prints short tables.

    python scripts/profile_gpu.py step gpt2-small        # Muon's step: kernel time by kernel, eager and graphed
    python scripts/profile_gpu.py train gpt2-small adamw muon muon+eager
                                                          # a training step: GPU busy vs span, largest idle gaps
    python scripts/profile_gpu.py launch                  # host time per eager launch of our kernels

``train`` uses ``matrixopt bench train``'s loop and optimizers. ``launch`` keeps the GPU busy behind a long
``torch.cuda._sleep`` so that the host never waits, and times back-to-back calls on the host.
"""

import argparse
import functools
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _kernels(prof) -> list[tuple[int, int, str]]:
    return sorted([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start])


def step(model: str) -> None:
    from matrixopt.bench.common import time_ms
    from matrixopt.bench.step import param_set
    from matrixopt.optim.registry import build_optimizer

    ps = param_set(model, torch.device("cuda"))
    for graph in (False, True):
        opt = build_optimizer(ps, "muon", lr=1e-3, deferred_nonfinite=True, cuda_graph=graph)
        t = time_ms(opt.step, torch.device("cuda"), reps=10, inner=5, warmup=5)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                opt.step()
            torch.cuda.synchronize()
        per = {}
        for s, e, name in _kernels(prof):
            per[name] = per.get(name, 0.0) + (e - s) / 5 / 1e3
        print(f"== {model} Muon, deferred check, cuda_graph={graph}: step {t['median']:.3f} ms (median), "
              f"kernels {sum(per.values()):.3f} ms")
        for name, ms in sorted(per.items(), key=lambda kv: -kv[1])[:20]:
            print(f"   {ms:7.3f} ms  {name[:100]}")
        del opt
        torch.cuda.empty_cache()


def train(model: str, names: list[str]) -> None:
    from matrixopt.bench import train as bt
    from matrixopt.train.model import GPT, PRESETS, GPTConfig

    B, T, vocab = bt.BATCHES[model]
    cfg = GPTConfig(vocab_size=vocab, tie_embeddings=False, **dict(PRESETS[model], block_size=T))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    for name in names:
        torch.manual_seed(0)
        with torch.device("cuda"):
            net = GPT(cfg)
        opt = bt._optimizer(net, name)
        x = torch.randint(0, vocab, (B, T), device="cuda")
        run = functools.partial(bt.train_step, net, opt, x, x.roll(1, 1), autocast)
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        n = 4
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                run()
            torch.cuda.synchronize()
        ks = _kernels(prof)
        busy, gaps, end, prev = 0, [], ks[0][0], ks[0][2]
        for s, e, kname in ks:
            if s > end:
                gaps.append(((s - end) / 1e3, prev[:50], kname[:50]))
            busy += max(0, e - max(s, end))
            if e >= end:
                end, prev = e, kname
        span = (ks[-1][1] - ks[0][0]) / 1e3 / n
        print(f"== {model} {name}: span {span:.2f} ms per step, GPU busy {busy / 1e3 / n:.2f} ms, idle "
              f"{sum(g[0] for g in gaps) / n:.2f} ms (profiled: the profiler slows the host)")
        for ms, after, before in sorted(gaps, reverse=True)[:6]:
            print(f"   gap {ms:.3f} ms after {after} before {before}")
        del net, opt
        torch.cuda.empty_cache()


def launch() -> None:
    import triton

    from matrixopt.kernels import ns_update as U
    from matrixopt.kernels import syrk as S

    @triton.jit
    def _noop(x_ptr):
        pass

    def host_us(fn, n=200):
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(3e9))
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        return t

    X = torch.randn(12, 768, 2304, device="cuda").bfloat16() / 48
    A = torch.randn(12, 768, 768, device="cuda").bfloat16() / 768
    out, xo = torch.empty_like(A), torch.empty_like(X)
    rows = {
        "empty Triton kernel": lambda: _noop[(1,)](X),
        "torch.bmm X X^T (cuBLAS)": lambda: torch.bmm(X, X.mT),
        "SYRK launch, pointer kernel": lambda: S._launch(X, X, None, out, 1.0, 0.0, S.SyrkConfig(128, 64, 1, 8, 4)),
        "SYRK launch, TMA kernel": lambda: S._launch(X, X, None, out, 1.0, 0.0, S.SyrkConfig(128, 64, 1, 8, 4, True)),
        "syrk() (tuned)": lambda: S.syrk(X),
        "update launch, pointer kernel": lambda: U._launch(A, X, xo, 2.0, U.GemmConfig(128, 128, 64, 8, 4, 4)),
        "update launch, TMA kernel": lambda: U._launch(A, X, xo, 2.0, U.GemmConfig(128, 128, 64, 8, 4, 4, True)),
    }
    for name, fn in rows.items():
        print(f"{name:32s} {host_us(fn):7.1f} us of host time per call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("step").add_argument("model", nargs="?", default="gpt2-small")
    p = sub.add_parser("train")
    p.add_argument("model", nargs="?", default="gpt2-small")
    p.add_argument("optimizers", nargs="*", default=["adamw", "muon", "muon+eager"])
    sub.add_parser("launch")
    args = parser.parse_args()
    if args.what == "step":
        step(args.model)
    elif args.what == "train":
        train(args.model, args.optimizers)
    else:
        launch()


if __name__ == "__main__":
    main()
