"""Tests for rlcore.algos.kl_control (Ziegler et al. 2019 adaptive KL controller)."""

from __future__ import annotations

import pytest
import torch
from numpy.testing import assert_allclose

from rlcore.algos.kl_control import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    make_kl_controller,
)


def test_fixed_controller_never_changes():
    ctrl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        ctrl.update(kl, n_steps=1024)
    assert ctrl.value == 0.05


def test_adaptive_controller_by_hand():
    ctrl = AdaptiveKLController(kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=500)
    # error = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2; mult = 1 + 0.2 * 500 / 10000 = 1.01
    assert_allclose(ctrl.value, 0.1 * 1.01, rtol=1e-12)
    ctrl.update(current_kl=3.0, n_steps=500)
    # error = clip(3/6 - 1 = -0.5) = -0.2; mult = 0.99
    assert_allclose(ctrl.value, 0.1 * 1.01 * 0.99, rtol=1e-12)
    ctrl.update(current_kl=6.6, n_steps=1000)
    # error = 6.6/6 - 1 = 0.1 (inside the clip); mult = 1 + 0.1 * 1000 / 10000 = 1.01
    assert_allclose(ctrl.value, 0.1 * 1.01 * 0.99 * 1.01, rtol=1e-12)


def test_adaptive_accepts_tensor_kl_and_is_unchanged_at_target():
    ctrl = AdaptiveKLController(kl_coef=0.2, target_kl=0.5, horizon=100)
    ctrl.update(torch.tensor(0.5), n_steps=64)
    assert_allclose(ctrl.value, 0.2, rtol=1e-12)


def test_make_kl_controller_by_name():
    fixed = make_kl_controller("fixed", kl_coef=0.3)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    adaptive = make_kl_controller("adaptive", kl_coef=0.1, target_kl=2.0, horizon=50)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.1, 2.0, 50.0)


def test_adaptive_requires_positive_target_and_horizon():
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=2.0, horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=None, horizon=10)


def test_registry_names_duplicates_and_unknown():
    assert set(KL_CONTROLLERS.names()) == {"fixed", "adaptive"}
    with pytest.raises(ValueError, match="already registered"):
        KL_CONTROLLERS.register("fixed")(lambda **kw: None)
    with pytest.raises(KeyError) as info:
        make_kl_controller("pid", kl_coef=0.1)
    assert "adaptive" in str(info.value) and "fixed" in str(info.value)


def test_a_controller_takes_exactly_its_options():
    with pytest.raises(TypeError, match="'target_kl'"):
        make_kl_controller("fixed", kl_coef=0.1, target_kl=2.0)  # a fixed coefficient has no target
    with pytest.raises(TypeError, match="'horizn'"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=2.0, horizn=10)
