import math

import pytest

from matrixopt.train.config import ScheduleConfig, TrainConfig, from_dict
from matrixopt.train.schedule import lr_multiplier


def test_defaults_are_nanogpt_cpu_quickstart():
    cfg = TrainConfig()
    shape = cfg.model.gpt_config(vocab_size=65)
    assert (shape.n_layer, shape.n_head, shape.n_embd, shape.block_size, shape.dropout) == (4, 4, 128, 64, 0.0)
    assert (cfg.batch_size, cfg.steps, cfg.optim.lr, cfg.schedule.min_lr_ratio) == (12, 2000, 1e-3, 0.1)
    assert (cfg.schedule.warmup_steps, cfg.optim.betas, cfg.optim.weight_decay, cfg.grad_clip) == (
        100, (0.9, 0.99), 0.1, 1.0)  # fmt: skip


def test_cosine_matches_nanogpt_get_lr():
    cfg = ScheduleConfig(warmup_steps=100, min_lr_ratio=0.1)
    assert lr_multiplier(0, 2000, cfg) == pytest.approx(1 / 101)  # nanoGPT: lr * (it + 1) / (warmup + 1)
    assert lr_multiplier(100, 2000, cfg) == pytest.approx(1.0)
    mid = 100 + (1999 - 100) / 2
    assert lr_multiplier(int(mid), 2000, cfg) == pytest.approx(0.55, abs=1e-3)
    assert lr_multiplier(1999, 2000, cfg) == pytest.approx(0.1)
    steps = [lr_multiplier(s, 2000, cfg) for s in range(100, 2000)]
    assert all(a >= b for a, b in zip(steps, steps[1:]))  # monotone decay after warmup


def test_wsd_and_constant():
    wsd = ScheduleConfig(schedule="wsd", warmup_steps=10, decay_frac=0.2, min_lr_ratio=0.0)
    assert [lr_multiplier(s, 100, wsd) for s in (10, 79)] == [1.0, 1.0]
    assert lr_multiplier(80, 100, wsd) == 1.0 and lr_multiplier(99, 100, wsd) == 0.0
    assert lr_multiplier(90, 100, wsd) == pytest.approx(1 - 10 / 19)
    const = ScheduleConfig(schedule="constant", warmup_steps=0)
    assert lr_multiplier(0, 100, const) == lr_multiplier(99, 100, const) == 1.0
    assert math.isclose(lr_multiplier(4, 100, ScheduleConfig(schedule="constant", warmup_steps=9)), 0.5)


def test_from_dict_builds_nested_configs_and_rejects_typos():
    cfg = from_dict(TrainConfig, {"optim": {"name": "muon", "lr": 2, "betas": [0.9, 0.95]}, "steps": 5})
    assert cfg.optim.lr == 2.0 and isinstance(cfg.optim.lr, float) and cfg.optim.betas == (0.9, 0.95)
    with pytest.raises(ValueError, match=r"unknown key 'warmup' in cfg.schedule; did you mean 'warmup_steps'\?"):
        from_dict(TrainConfig, {"schedule": {"warmup": 5}}, where="cfg")
    with pytest.raises(ValueError, match=r"config.steps must be <class 'int'>, got '5'"):
        from_dict(TrainConfig, {"steps": "5"})
    with pytest.raises(ValueError, match="schedule must be one of cosine, wsd, constant, got 'linear'"):
        from_dict(TrainConfig, {"schedule": {"schedule": "linear"}})


def test_optimizer_kwargs_defer_the_nonfinite_check_where_the_optimizer_can():
    from matrixopt.train.config import OptimConfig

    kw = lambda name, **hp: OptimConfig(name=name, hparams=hp).optimizer_kwargs()  # noqa: E731
    assert kw("muon")["deferred_nonfinite"] is True and kw("muon")["adamw_betas"] == (0.9, 0.99)
    assert "deferred_nonfinite" not in kw("adamw") and kw("shampoo")["deferred_nonfinite"] is True
    assert kw("soap")["deferred_nonfinite"] is True
    assert "deferred_nonfinite" not in kw("muon", skip_nonfinite=True)
    assert kw("muon", deferred_nonfinite=False)["deferred_nonfinite"] is False
