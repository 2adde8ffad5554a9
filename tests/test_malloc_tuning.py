"""The relay's glibc heap padding (malloc_tuning.py): set on glibc, left to the operator when
MALLOC_TOP_PAD_ is in the environment."""

from __future__ import annotations

import platform

import pytest

from rmb_relay import malloc_tuning


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_top_pad_is_set_on_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_TOP_PAD_", raising=False)
    assert malloc_tuning.tune_for_serving() is True


def test_an_operators_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")
    assert malloc_tuning.tune_for_serving() is False
