"""Property-based sweep: every configuration either works or raises TypeError/ValueError.

Never a crash of another kind, never a hang, never a silent fallback: a configuration that
is accepted must be reflected, value for value, in the object that was built.
"""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_boost import AdaSum, AutoBoost, DynamicLossScale, FixedLossScale, GradientAccumulation, GradientFreeze
from keras_boost.config import DEFAULTS, FEATURES, LEVELS, MODES

SWEEP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
anything = st.one_of(st.none(), st.booleans(), st.integers(-5, 70000), st.floats(allow_nan=True, allow_infinity=True),
                     st.text(max_size=6), st.lists(st.integers(-3, 200), max_size=3))


def accepted_or_clear_error(build):
    try:
        return build()
    except (TypeError, ValueError):
        return None


@SWEEP
@given(level=st.one_of(st.sampled_from(["O0", "O1", "O2"]), st.text(max_size=3)),
       mode=st.one_of(st.sampled_from(MODES), anything),
       switches=st.dictionaries(st.sampled_from([*FEATURES, "dim_reduce", "bogus"]), anything, max_size=3),
       section=st.sampled_from(list(DEFAULTS) + ["dim_reduce", "nonsense"]),
       key=st.sampled_from(sorted({k for v in DEFAULTS.values() for k in v} | {"device_num", "n_component"})),
       value=anything)
def test_autoboost_configuration_space(level, mode, switches, section, key, value):
    config = {"boost": {"mode": mode, **switches}, section: {key: value}}
    auto = accepted_or_clear_error(lambda: AutoBoost(level, config))
    if auto is None:
        return
    assert auto.level in ("O0", "O1", "O2") and auto.mode in MODES
    assert auto.params[section][key] == value  # accepted means used, not dropped
    json.dumps(auto.get_config())  # and it can be written back
    if auto.mode != "manual":  # switches are ignored outside manual mode, as in MindSpore (with a warning)
        expected = {"enable_all": dict.fromkeys(FEATURES, True), "disable_all": dict.fromkeys(FEATURES, False)}
        assert auto.features == expected.get(auto.mode, LEVELS[auto.level])


@SWEEP
@given(init=anything, factor=anything, window=anything, low=anything, high=anything, hysteresis=anything)
def test_dynamic_loss_scale_space(init, factor, window, low, high, hysteresis):
    scale = accepted_or_clear_error(lambda: DynamicLossScale(init, factor, window, low, high, hysteresis))
    if scale is not None:
        assert scale.init_scale > 0 and math.isfinite(scale.init_scale) and scale.scale_factor > 1
        assert scale.scale_window >= 1 and scale.hysteresis >= 1
        assert scale.min_scale <= scale.init_scale <= (scale.max_scale or math.inf)


@SWEEP
@given(value=anything, drop=anything, steps=anything)
def test_fixed_scale_and_accumulation_space(value, drop, steps):
    fixed = accepted_or_clear_error(lambda: FixedLossScale(value, drop))
    if fixed is not None:
        assert fixed.value == value and fixed.drop_overflow_update is drop
    accumulation = accepted_or_clear_error(lambda: GradientAccumulation(steps))
    if accumulation is not None:
        assert accumulation.max_accumulation_step == steps >= 1


@SWEEP
@given(groups=anything, kind=anything, p=anything, total=st.one_of(st.integers(-3, 3000), anything), seed=anything)
def test_gradient_freeze_space(groups, kind, p, total, seed):
    freeze = accepted_or_clear_error(lambda: GradientFreeze(groups, kind, p, total, seed))
    if freeze is not None:
        sequence = freeze.generate_freeze_index_sequence()
        assert len(sequence) >= int(total * 1.01)
        assert sequence.min() >= 0 and sequence.max() < max(groups, 1)


@SWEEP
@given(rank=anything, device_number=anything, group_number=anything, backend=anything)
def test_adasum_space(rank, device_number, group_number, backend):
    stage = accepted_or_clear_error(lambda: AdaSum(rank, device_number, group_number, None, backend))
    if stage is not None:
        assert stage.backend in ("auto", "native", "exact")


@pytest.mark.parametrize("bad", ["{'boost': 1}", "__import__('os').system('false')", "[1, 2"])
def test_configuration_files_are_json_only(tmp_path, bad):
    path = tmp_path / "config.json"
    path.write_text(bad)
    with pytest.raises(ValueError, match="not valid JSON"):
        AutoBoost("O1", str(path))


# ------------------------------------------------ values inside the documented ranges
# The sweeps above accept any TypeError/ValueError, so a constructor that refused every
# value would pass them; these draw only documented values, which must all be accepted
# (an exception fails the test) and kept value for value.
VALID = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
positive = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


@VALID
@given(init=st.floats(1.0, 2.0**24), factor=st.one_of(st.integers(2, 16), st.floats(1.001, 16.0)),
       window=st.integers(1, 100000), hysteresis=st.integers(1, 20), headroom=st.one_of(st.none(), st.floats(1.0, 8.0)))
def test_dynamic_loss_scale_accepts_documented_values(init, factor, window, hysteresis, headroom):
    high = None if headroom is None else init * headroom
    scale = DynamicLossScale(init, factor, window, 1, high, hysteresis)
    assert (scale.init_scale, scale.scale_factor, scale.scale_window) == (init, factor, window)
    assert (scale.min_scale, scale.max_scale, scale.hysteresis) == (1, high, hysteresis)


@VALID
@given(value=positive, drop=st.booleans(), steps=st.integers(1, 10000))
def test_fixed_scale_and_accumulation_accept_documented_values(value, drop, steps):
    fixed = FixedLossScale(value, drop)
    assert fixed.value == value and fixed.drop_overflow_update is drop
    assert GradientAccumulation(steps).max_accumulation_step == steps


@VALID
@given(groups=st.integers(1, 50), kind=st.sampled_from([0, 1]), p=st.floats(1e-3, 1.0), total=st.integers(1, 3000),
       seed=st.integers(0, 2**32 - 1))
def test_gradient_freeze_accepts_documented_values(groups, kind, p, total, seed):
    freeze = GradientFreeze(groups, kind, p, total, seed)
    assert freeze.get_config() == {"param_groups": groups, "freeze_type": kind, "freeze_p": p,
                                   "total_steps": total, "seed": seed}
    sequence = freeze.generate_freeze_index_sequence()
    assert len(sequence) >= total and sequence.min() >= 0 and sequence.max() < groups


@VALID
@given(rank=st.one_of(st.none(), st.integers(0, 1000)), device_number=st.one_of(st.none(), st.integers(1, 64)),
       group_number=st.one_of(st.none(), st.integers(1, 64)), backend=st.sampled_from(["auto", "native", "exact"]))
def test_adasum_accepts_documented_values(rank, device_number, group_number, backend):
    stage = AdaSum(rank, device_number, group_number, None, backend)
    assert (stage.rank, stage.device_number, stage.group_number, stage.backend) == (
        rank, device_number, group_number, backend)


@VALID
@given(level=st.sampled_from(["O0", "O1", "O2"]), mode=st.sampled_from(MODES),
       freeze_p=st.floats(1e-3, 1.0), total_steps=st.integers(1, 100000), param_groups=st.integers(1, 50),
       accumulation=st.integers(1, 64))
def test_autoboost_accepts_documented_values(level, mode, freeze_p, total_steps, param_groups, accumulation):
    config = {"boost": {"mode": mode},
              "grad_freeze": {"freeze_p": freeze_p, "total_steps": total_steps, "param_groups": param_groups},
              "grad_accumulation": {"grad_accumulation_step": accumulation}}
    auto = AutoBoost(level, config)
    assert (auto.level, auto.mode) == (level, mode)
    assert auto.params["grad_freeze"] == {**DEFAULTS["grad_freeze"], **config["grad_freeze"]}
    assert auto.params["grad_accumulation"]["grad_accumulation_step"] == accumulation
    json.dumps(auto.get_config())


def test_every_compile_option_refuses_a_bad_value_in_one_style():
    """`<option>` must be <the whole allowed set>, got <value> (<type>). -- the option named as the user wrote it."""
    import keras

    import keras_boost
    from keras_boost.step import registry

    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2)(inputs)
    for option in registry.options():
        if option in ("optimizer_update",):  # the default update stage: no compile keyword of its own
            continue
        model = keras_boost.BoostModel(inputs, outputs)
        with pytest.raises((TypeError, ValueError)) as raised:
            model.compile(optimizer="sgd", loss="mse", **{option: object()})
        message = str(raised.value)
        assert message.startswith(f"`{option}` must be "), (option, message)
        assert ", got <object" in message and message.rstrip(".").endswith("(object)"), (option, message)
        assert " a AdaSum" not in message and " a Adasum" not in message
    # a value of the right kind outside what is allowed: ValueError, in the same style
    for option, value in (("gradient_accumulation", 0), ("loss_scale", "fast"), ("gradient_centralization", "every")):
        model = keras_boost.BoostModel(inputs, outputs)
        with pytest.raises(ValueError) as raised:
            model.compile(optimizer="sgd", loss="mse", **{option: value})
        assert str(raised.value).startswith(f"`{option}` must be "), (option, str(raised.value))
        assert f", got {value!r} ({type(value).__name__})." in str(raised.value), (option, str(raised.value))
