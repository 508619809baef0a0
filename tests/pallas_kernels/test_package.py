"""The kernels package's surface: every public name loads on access, names.py needs no jax."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pallas_kernels as pk
from pallas_kernels import names
from pallas_kernels.quantization import FP8_KV_CACHE_DTYPES


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(eval(out))  # a printed list of str


def test_names_import_without_jax():
    loaded = _modules_after("import pallas_kernels\nfrom pallas_kernels.names import BACKEND_NAMES")
    assert not {m for m in loaded if m == "jax" or m.startswith(("jax.", "jaxlib"))}


def test_the_reference_backend_does_not_load_the_pallas_kernels():
    loaded = _modules_after("import pallas_kernels\npallas_kernels.get_attention_ops('reference')")
    assert "pallas_kernels.reference" in loaded
    assert not loaded & {"pallas_kernels.decode_attention", "pallas_kernels.ragged_attention"}


def test_every_public_name_resolves():
    for name in pk.__all__:
        assert getattr(pk, name) is not None, name
    assert set(pk.__all__) <= set(dir(pk))
    assert callable(pk.step_attention) and callable(pk.paged_attention)
    assert pk.reference.__name__ == "pallas_kernels.reference"
    assert pk.BACKEND_NAMES == (
        "auto",
        "pallas",
        "pallas_interpret",
        "reference",
        "mosaic_gpu",
        "mosaic_gpu_interpret",
    )


def test_the_names_are_the_literal_types_and_the_fp8_table():
    assert get_args(names.AttentionBackend) == names.BACKEND_NAMES
    assert tuple(FP8_KV_CACHE_DTYPES) == names.FP8_KV_CACHE_DTYPE_NAMES


def test_no_submodule_shadows_a_public_name():
    # Importing pallas_kernels.X binds the submodule as the package attribute X, so a
    # submodule named like a lazily loaded function would replace that function.
    import pathlib

    folder = pathlib.Path(pk.__file__).parent
    submodules = {p.stem for p in folder.glob("*.py")}
    assert submodules & set(pk.__all__) == {"reference"}  # `reference` is the module itself
    loaded = _modules_after(
        "import pallas_kernels.backend, pallas_kernels as pk\nassert callable(pk.step_attention)"
    )
    assert "pallas_kernels.backend" in loaded
