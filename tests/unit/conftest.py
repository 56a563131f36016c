"""Fixtures of the unit tier: the tiny model is optional here (skip, never fail, without the engine venv)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.engine_proc import EngineChildError, engine_python


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The project's tiny random-weight Llama (written once, in the engine venv), else a skip."""
    from testbed.tiny_model import ensure_tiny_model

    try:
        engine_python()
        return ensure_tiny_model()
    except EngineChildError as exc:
        pytest.skip(f"tiny model unavailable: {exc}")
