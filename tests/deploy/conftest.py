"""Fixtures of the deployment tests: the chart loaded once, every values profile rendered once."""

from __future__ import annotations

import pytest
from tests.deploy.deploy_helpers import CHART, PROFILES, load_values, render_docs


@pytest.fixture(scope="session")
def helm():
    return pytest.importorskip("helm_python", reason="helm-python-sdk (the `dev` extra) is not installed")


@pytest.fixture(scope="session")
def chart(helm):
    with helm.Chart.load(CHART) as c:
        yield c


@pytest.fixture(scope="session")
def rendered(chart):
    """Every profile rendered once per session: profile -> template path -> objects."""
    return {name: render_docs(chart, load_values(path)) for name, path in PROFILES.items()}
