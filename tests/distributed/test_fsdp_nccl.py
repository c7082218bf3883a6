"""Sharded Muon and NorMuon under FSDP2 over NCCL on two GPUs, with the trainer's deferred non-finite check: a
step with a NaN in one rank's shard writes nothing on either rank (the fused kernels skip on the agreed device
flag), both ranks raise at the next step, and the run then equals, bit for bit, a run without that step (also
two clean runs equal each other: the sharded second moments sum their pieces' norms in a fixed order). Skipped
without two GPUs; the same logic runs on gloo through Triton's interpreter in test_fsdp.py."""

from __future__ import annotations

import pytest
import torch
from _mp import run
from torch import nn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 96),
                                     nn.Linear(96, 64)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from matrixopt import NonFiniteGradientError
    from matrixopt.distributed.fsdp import apply_fsdp
    from matrixopt.distributed.sharded import ShardedMuon, ShardedNorMuon
    from matrixopt.optim.routing import param_groups

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    mine = slice(rank * 4, rank * 4 + 4)

    def steps(cls: type, nan: bool) -> list[torch.Tensor]:
        """Steps 0, 1, 3 and 4; with ``nan``, step 2 has a NaN in rank 1's shard and is skipped."""
        torch.manual_seed(0)
        model = apply_fsdp(Net().cuda(), mesh)
        opt = cls(param_groups(model), lr=0.02, weight_decay=0.01, deferred_nonfinite=True)
        for step in range(5):
            if step == 2 and not nan:
                continue
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(8, 64, generator=g).cuda(), torch.randn(8, 64, generator=g).cuda()
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            if step != 2:
                opt.step()
                opt.zero_grad()
                continue
            if rank == 1:
                model.layers[1].weight.grad.to_local()[0, 0] = float("nan")
            before = [p.to_local().clone() for p in model.parameters()]
            state = [t.to_local().clone() if hasattr(t, "to_local") else t.clone()
                     for st in opt.state.values() for t in st.values()]
            opt.step()  # no error: skipped on the device
            opt.zero_grad()
            assert all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
            after = [t.to_local() if hasattr(t, "to_local") else t for st in opt.state.values() for t in st.values()]
            assert len(after) == len(state) and all(torch.equal(a, b) for a, b in zip(state, after))
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            with pytest.raises(NonFiniteGradientError, match="skipped"):
                opt.step()
            opt.zero_grad()
        return [p.full_tensor() for p in model.parameters()]

    for cls in (ShardedMuon, ShardedNorMuon):
        clean = steps(cls, False)
        for runs in (steps(cls, False), steps(cls, True)):
            assert all(torch.equal(a, b) for a, b in zip(clean, runs)), cls.__name__


def test_fsdp2_deferred_nonfinite_skips_on_nccl_and_runs_repeat_exactly():
    run(_worker, 2, backend="nccl", timeout=180)


def _offload_worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from matrixopt.distributed.fsdp import apply_fsdp
    from matrixopt.distributed.sharded import ShardedMuon, ShardedNorMuon
    from matrixopt.optim.routing import param_groups

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    mine = slice(rank * 4, rank * 4 + 4)

    def run_steps(cls: type, **options) -> tuple[list[torch.Tensor], list[torch.Tensor], ShardedMuon]:
        torch.manual_seed(0)
        model = apply_fsdp(Net().cuda(), mesh)
        opt = cls(param_groups(model), lr=0.02, weight_decay=0.01, deferred_nonfinite=True, **options)
        for step in range(12):
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(8, 64, generator=g).cuda(), torch.randn(8, 64, generator=g).cuda()
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        state = [(i, k, getattr(t, "to_local", lambda t=t: t)().cpu()) for i, p in enumerate(model.parameters())
                 for k, t in sorted(opt.state[p].items()) if torch.is_tensor(t)]
        return [p.full_tensor() for p in model.parameters()], state, opt

    for cls in (ShardedMuon, ShardedNorMuon):
        for state_dtype in (None, "bf16"):
            want, want_state, _ = run_steps(cls, state_dtype=state_dtype)
            got, got_state, opt = run_steps(cls, state_dtype=state_dtype, offload="cpu")
            name = f"{cls.__name__} {state_dtype}"
            assert all(torch.equal(a, b) for a, b in zip(want, got)), name
            differ = [(i, k, a.dtype, b.dtype, tuple(a.shape), tuple(b.shape), (a.double() - b.double()).abs().max())
                      for (i, k, a), (_, _, b) in zip(want_state, got_state) if not torch.equal(a, b)]
            assert [x[:2] for x in want_state] == [x[:2] for x in got_state] and not differ, (name, differ)
            assert all(t.to_local().is_pinned() for st in opt.state.values() for t in st.values()
                       if hasattr(t, "to_local")), name


def test_fsdp2_offloaded_state_steps_as_on_the_device_on_nccl():
    """ShardedMuon and ShardedNorMuon under FSDP2 with their state offloaded to pinned host memory (copy streams,
    the clip's coefficient applied in the step): parameters and state bit for bit those of the same optimizer with
    its state on the GPU, with float32 and with bf16 state, over 12 steps."""
    run(_offload_worker, 2, backend="nccl", timeout=300)
