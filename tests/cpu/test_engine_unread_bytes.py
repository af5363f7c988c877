"""A rule of parameter bytes some kernels never read (graphpersist.engine.UnreadBytes), written once for every engine's
`unused_param_bytes`: the bytes only for the layout the rule was proven on, else none and a warning."""

from __future__ import annotations

import logging
import re

import pytest

from graphpersist import engine

RULE = engine.UnreadBytes("test kernel", re.compile(r"KernelA<.*128>"), 112, ((124, 128), (304, 488)))
LOGGER = logging.getLogger("graphpersist.test_unread_bytes")


def test_a_matching_kernel_of_the_checked_layout_has_the_rules_bytes_as_buffer_offsets() -> None:
    assert RULE("KernelA<float, 128>", [(112, 2560)], LOGGER) == [(124, 128), (304, 488)]


def test_another_kernel_has_none_and_nothing_is_said(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        assert RULE("KernelA<float, 64>", [(112, 2560)], LOGGER) == []
    assert caplog.text == ""


@pytest.mark.parametrize("layout", [[(0, 8), (8, 2792)], [(0, 2800)], [(112, 200)]])
def test_a_matching_kernel_of_another_layout_keeps_its_bytes_and_is_named(
    layout: list[tuple[int, int]], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        assert RULE("KernelA<float, 128>", layout, LOGGER) == []
    assert (
        f"graphpersist: test kernel KernelA<float, 128> has the parameter layout {layout}, not the one checked (one "
        "parameter block at buffer byte 112 holding bytes 124-487)"
    ) in caplog.text
