"""The GPU check under pytest: each check of checks.py on CUDA (skipped with the reason where CUDA is absent)."""

from __future__ import annotations

import pytest

from checks import CHECKS, Context, Skip, accelerator

DEVICE, ABOUT = accelerator()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE is None, reason=ABOUT)]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> Context:
    return Context(device=DEVICE or "cuda", work=tmp_path_factory.mktemp("gpu"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_check(name, ctx):
    try:
        print(CHECKS[name](ctx))
    except Skip as e:
        pytest.skip(str(e))
