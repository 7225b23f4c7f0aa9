"""Where the bundled demo checkpoints live (inside the installed package, so they ship with it)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"


def bundled_target() -> Path:
    """The demo VLM: a standard Hugging Face Qwen2.5-VL directory."""
    return ASSETS / "target"


def bundled_drafter() -> Path:
    """The GLANCE drafter trained for the demo VLM."""
    return ASSETS / "drafter"
