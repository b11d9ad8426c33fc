from __future__ import annotations

import json

import pytest

from ooc.scheduler import BlockProfile, Hardware, HardwareError, Profile, ProfileError, preset
from ooc.scheduler.profile import PROFILE_FORMAT_VERSION


def _profile() -> Profile:
    return Profile((BlockProfile("a", 1e-3, 2e-3, 100, 80, 10, 10, 10, 4, 4),), machine={"host": "x"})


def test_profile_round_trip(tmp_path) -> None:
    prof = _profile()
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path) == prof
    assert not (tmp_path / "p.json.tmp").exists()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(version=PROFILE_FORMAT_VERSION + 1), "newer than this ooc"),
        (lambda d: d.update(format="x"), "not an ooc profile"),
        (lambda d: d["blocks"][0].pop("saved_bytes"), "corrupt"),
        (lambda d: d["blocks"][0].update(saved_bytes=-1), "must be >= 0"),
        (lambda d: d["blocks"][0].update(swappable_bytes=1000), "exceeds"),
    ],
)
def test_bad_profiles(mutate, message) -> None:
    data = _profile().to_dict()
    mutate(data)
    with pytest.raises(ProfileError, match=message):
        Profile.from_json(json.dumps(data))


def test_missing_and_corrupt_files(tmp_path) -> None:
    with pytest.raises(ProfileError, match="ooc profile --out"):
        Profile.load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ProfileError, match="corrupt"):
        Profile.load(tmp_path / "bad.json")


def test_profile_must_match_the_model() -> None:
    with pytest.raises(ProfileError, match="profile this model again"):
        _profile().check_matches(["a", "b"])
    _profile().check_matches(["a"])


@pytest.mark.parametrize("field", ["h2d", "d2h", "h2d_duplex", "d2h_duplex", "d2d", "host_optimizer"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_bandwidths_must_be_positive(field, value) -> None:
    data = preset("v100-16gb").to_dict()
    data[field] = value
    with pytest.raises(HardwareError, match=field):
        Hardware.from_dict(data)


def test_presets_and_round_trip() -> None:
    for name in ("v100-16gb", "a100-40gb", "h100-sxm", "h200", "cpu"):
        hw = preset(name)
        assert Hardware.from_dict(json.loads(hw.to_json())) == hw
        assert hw.source
        assert name in hw.describe()
    with pytest.raises(HardwareError, match="choose one of"):
        preset("tpu")
    data = preset("h100-sxm").to_dict()
    data["h2d_duplex"] = data["h2d"] * 2
    with pytest.raises(HardwareError, match="duplex"):
        Hardware.from_dict(data)
