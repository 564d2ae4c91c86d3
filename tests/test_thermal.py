"""The simulated phone's two-node thermal model against its closed-form behaviour with the shipped profile."""

import math

import pytest

from lcsb_cli.backends.npu_sim.device import DeviceModel, load_profile
from lcsb_cli.backends.npu_sim.thermal import Thermal

PROFILE = load_profile("snapdragon-8gen3")
TAU_SKIN = PROFILE.skin_heat_capacity_j_per_c * PROFILE.skin_to_ambient_c_per_w
TAU_SOC = PROFILE.soc_heat_capacity_j_per_c * PROFILE.soc_to_skin_c_per_w


def test_a_sustained_load_heats_the_skin_with_its_time_constant_and_throttles_at_throttle_c():
    # NPU + CPU lanes busy: above the ~4 W this phone sustains at its skin limit
    power = 6.0
    rise = power * PROFILE.skin_to_ambient_c_per_w
    thermal = Thermal(PROFILE)
    assert thermal.advance(TAU_SKIN, power) == []
    assert thermal.skin_c - PROFILE.ambient_c == pytest.approx(rise * (1 - math.exp(-1)), rel=0.05)
    assert thermal.soc_c - thermal.skin_c == pytest.approx(power * PROFILE.soc_to_skin_c_per_w, rel=0.02)
    seconds, events = TAU_SKIN, []
    while not events:
        events = thermal.advance(1.0, power)
        seconds += 1.0
    # the skin's limit
    assert events == ["npu_clock_throttled"] and thermal.soc_c < PROFILE.junction_throttle_c
    assert thermal.skin_c == pytest.approx(PROFILE.throttle_c, abs=0.05)
    one_mass = -TAU_SKIN * math.log(1 - (PROFILE.throttle_c - PROFILE.ambient_c) / rise)
    assert seconds == pytest.approx(one_mass, rel=0.05)


def test_at_idle_the_soc_settles_in_seconds_and_the_skin_cools_with_its_time_constant():
    thermal = Thermal(PROFILE)
    thermal.advance(3 * TAU_SKIN, 6.0)
    idle = PROFILE.idle_power_w
    # SoC over body, above idle's
    offset = thermal.soc_c - thermal.skin_c - idle * PROFILE.soc_to_skin_c_per_w
    thermal.advance(TAU_SOC, idle)
    assert thermal.soc_c - thermal.skin_c - idle * PROFILE.soc_to_skin_c_per_w == pytest.approx(
        offset * math.exp(-1), rel=0.1
    )
    floor = PROFILE.ambient_c + idle * PROFILE.skin_to_ambient_c_per_w
    excess = thermal.skin_c - floor
    events = thermal.advance(TAU_SKIN, idle)
    assert thermal.skin_c - floor == pytest.approx(excess * math.exp(-1), rel=0.05)
    # 5 C under the limit by now
    assert events == ["npu_clock_restored"]


def test_a_burst_trips_the_npu_junction_within_seconds_while_the_skin_is_still_cool():
    thermal, seconds, events = Thermal(PROFILE), 0.0, []
    while not events and seconds < 60:
        events = thermal.advance(0.5, 16.0)
        seconds += 0.5
    assert events == ["npu_clock_throttled"] and seconds < 6 * TAU_SOC
    assert thermal.soc_c >= PROFILE.junction_throttle_c and thermal.skin_c < PROFILE.throttle_c - 10


def test_the_state_round_trips():
    thermal = Thermal(PROFILE)
    thermal.advance(100.0, 5.0)
    copy = Thermal(PROFILE)
    copy.load_state_dict(thermal.state_dict())
    assert copy.advance(1.0, 5.0) == thermal.advance(1.0, 5.0) and copy.state_dict() == thermal.state_dict()


def test_a_checkpoint_of_the_one_node_model_resumes_with_both_nodes_at_its_temperature():
    device = DeviceModel(PROFILE)
    device.load_state_dict({"temp_c": 43.0, "throttled": True, "throttled_s": 12.0})
    assert (device.thermal.soc_c, device.temp_c, device.throttled, device.throttled_s) == (43.0, 43.0, True, 12.0)


def _at(soc_c: float, skin_c: float, throttled: bool) -> list[str]:
    """The clock events of a phone put at these temperatures (no time passes)."""
    thermal = Thermal(PROFILE)
    thermal.load_state_dict({"soc_c": soc_c, "skin_c": skin_c, "throttled": throttled})
    return thermal.advance(0.0, 0.0)


def test_the_clock_comes_back_only_when_both_nodes_are_hysteresis_below_their_limits():
    skin, junction, margin = PROFILE.throttle_c, PROFILE.junction_throttle_c, PROFILE.hysteresis_c
    assert _at(30.0, skin, False) == ["npu_clock_throttled"] and _at(junction, 30.0, False) == ["npu_clock_throttled"]
    assert _at(30.0, skin - 0.1, False) == [] and _at(junction - 0.1, 30.0, False) == []
    # below the limit, not yet by the hysteresis
    assert _at(30.0, skin - margin + 0.1, True) == []
    # the skin is cool, the SoC is not
    assert _at(junction - margin + 0.1, 30.0, True) == []
    assert _at(junction - margin - 0.1, skin - margin - 0.1, True) == ["npu_clock_restored"]
