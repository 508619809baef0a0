"""The installed package layout: models/ installs as paged_jax.models, every package is listed."""

from __future__ import annotations

import importlib
import pathlib


def test_models_dir_is_installed_as_paged_jax_models():
    mod = importlib.import_module("paged_jax.models")
    assert pathlib.Path(mod.__file__).parent.name == "models"
    root = pathlib.Path(importlib.import_module("paged_jax").__file__).parent.parent
    assert pathlib.Path(mod.__file__).parent == root / "models"


def test_kernels_package_is_importable_on_its_own():
    mod = importlib.import_module("pallas_kernels")
    assert pathlib.Path(mod.__file__).parent.name == "pallas_kernels"


def test_every_subpackage_is_listed_for_installation():
    """A package missing from pyproject's list works in the editable install but not from a wheel."""
    import tomllib

    root = pathlib.Path(__file__).resolve().parent.parent
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {"paged_jax.models", "pallas_kernels"}
    for init in (root / "paged_jax").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(root).parts))
    for init in (root / "pallas_kernels").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(root).parts))
    assert found <= listed, f"not installed: {sorted(found - listed)}"
