"""Helpers of the deployment tests: paths, values profiles, offline rendering with the embedded Helm engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "glance"
DOCKER = ROOT / "deploy" / "docker"
HERE = Path(__file__).resolve().parent

PROFILES = {
    "default": None,
    "cpu-demo": CHART / "values-cpu-demo.yaml",
    "gpu": CHART / "values-gpu.yaml",
    "all-on": HERE / "values-all-on.yaml",
}
RELEASE, NAMESPACE = "glance", "ml-serving"


def load_values(path: Path | None) -> dict[str, Any] | None:
    import yaml

    return None if path is None else yaml.safe_load(path.read_text())


def render_docs(chart, values: dict[str, Any] | None) -> dict[str, list[dict[str, Any]]]:
    """Render the chart; returns template path -> the Kubernetes objects it produced (NOTES.txt left out)."""
    import yaml

    out = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs: dict[str, list[dict[str, Any]]] = {}
    for name, text in out.items():
        if name.endswith("NOTES.txt"):
            continue
        docs[name] = [d for d in yaml.safe_load_all(text) if d]
    return docs


def objects(docs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [d for ds in docs.values() for d in ds]


def find(docs, kind: str, name_suffix: str = "") -> list[dict[str, Any]]:
    return [o for o in objects(docs) if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
