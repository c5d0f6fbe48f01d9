"""When the Gluon kernels run: with a Triton of the tested range unless MOK_WARP_SPECIALIZED says
otherwise, and with a warning, once, where an untested Triton turns them off. Bugs these catch:
an untested Triton running Gluon kernels whose API it changed (a failure at the first call
instead of the tl twins), the tl kernels chosen silently (a slower layer with no reason given),
the user's override ignored, and a warning at every call."""

from __future__ import annotations

import warnings

import pytest

from mok.kernels import gluon_support


@pytest.mark.parametrize(
    ("version", "setting", "off"),
    [
        ((3, 6), None, None),
        ((3, 9), None, None),
        ((3, 10), None, "Triton 3.10 is outside the Gluon kernels' tested range 3.6 to 3.9"),
        ((3, 5), None, "Triton 3.5 is outside"),
        ((3, 10), "1", None),
        ((3, 9), "0", "MOK_WARP_SPECIALIZED=0"),
        (None, None, "Triton is not installed"),
    ],
)
def test_the_gluon_kernels_run_with_a_tested_triton_or_when_asked(
    monkeypatch, version, setting, off
):
    monkeypatch.setattr(gluon_support, "triton_version", lambda: version)
    if setting is None:
        monkeypatch.delenv(gluon_support.SETTING, raising=False)
    else:
        monkeypatch.setenv(gluon_support.SETTING, setting)
    reason = gluon_support.off_reason()
    assert (reason is None) if off is None else (off in reason)


def test_an_untested_triton_warns_once_and_the_setting_silently(monkeypatch):
    monkeypatch.delenv(gluon_support.SETTING, raising=False)
    monkeypatch.setattr(gluon_support, "triton_version", lambda: (3, 11))
    gluon_support._warn_once.cache_clear()
    with pytest.warns(UserWarning, match="tl kernels in place of the Gluon ones: Triton 3.11"):
        assert not gluon_support.enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not gluon_support.enabled()  # once per reason
        monkeypatch.setenv(gluon_support.SETTING, "0")
        assert not gluon_support.enabled()  # asked for: no warning
    gluon_support._warn_once.cache_clear()


def test_the_installed_triton_is_in_the_range_the_package_declares():
    """pyproject.toml's triton range is TESTED_TRITON: a user's pip never picks an untested one."""
    from pathlib import Path

    declared = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    low, high = gluon_support.TESTED_TRITON
    assert f'"triton>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"' in declared
    version = gluon_support.triton_version()
    if version is not None:
        assert low <= version <= high, version
