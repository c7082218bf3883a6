"""The lr schedule as a torch LR scheduler: each group's initial lr times lr_multiplier, and a resume from its
state_dict sets the lrs of an uninterrupted run, to the bit."""

import torch

from matrixopt.train.schedule import LRSchedule, ScheduleConfig, lr_multiplier

STEPS = 20
CFG = ScheduleConfig(schedule="cosine", warmup_steps=3)


def optimizer() -> torch.optim.Optimizer:
    w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.3}], lr=0.1)


def lrs_over_steps(opt: torch.optim.Optimizer, schedule: LRSchedule, steps: int) -> list[list[float]]:
    """The lrs each optimizer step runs with."""
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        schedule.step()
    return out


def test_each_group_gets_its_initial_lr_times_the_multiplier():
    opt = optimizer()
    got = lrs_over_steps(opt, LRSchedule(opt, STEPS, CFG), STEPS)
    assert got == [[0.1 * lr_multiplier(s, STEPS, CFG), 0.3 * lr_multiplier(s, STEPS, CFG)] for s in range(STEPS)]


def test_resume_from_state_dict_matches_the_uninterrupted_lrs_bitwise():
    opt = optimizer()
    whole = lrs_over_steps(opt, LRSchedule(opt, STEPS, CFG), STEPS)

    opt = optimizer()
    schedule = LRSchedule(opt, STEPS, CFG)
    first = lrs_over_steps(opt, schedule, 7)
    saved_opt, saved_schedule = opt.state_dict(), schedule.state_dict()

    opt = optimizer()  # a fresh process: built as at the start, then loaded
    schedule = LRSchedule(opt, STEPS, CFG)
    opt.load_state_dict(saved_opt)
    schedule.load_state_dict(saved_schedule)
    assert first + lrs_over_steps(opt, schedule, STEPS - 7) == whole
