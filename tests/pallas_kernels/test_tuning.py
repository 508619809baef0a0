"""The tuned-config table: exact and nearest lookups, validation naming the field, writes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tomllib

import jax.numpy as jnp
import pytest

from pallas_kernels import tuning

ROOT = pathlib.Path(__file__).resolve().parents[2]
H200 = "NVIDIA H200"


def entry(**over):
    e = dict(
        kernel="paged_decode_attention",
        device_kind=H200,
        dtype="bfloat16",
        head_dim=128,
        group=4,
        block_size=16,
        config=dict(block_k=64, num_stages=4, num_warps=4),
        measured=dict(us=100.0, fraction_of_peak=0.8, jax_version="x", command="c"),
    )
    e.update(over)
    return e


def write(tmp_path, entries, **top):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(dict(dict(format=1, entries=entries), **top)))
    return path


def lookup(path, **over):
    kw = dict(device_kind=H200, dtype=jnp.bfloat16, head_dim=128, group=4, block_size=16)
    kw.update(over)
    return tuning.tuned_config(kw.pop("kernel", "paged_decode_attention"), path=path, **kw)


def test_committed_table_is_valid_and_says_why_it_is_empty():
    data = json.loads(tuning.TABLE_PATH.read_text())
    table = tuning.load_table()
    assert data["format"] == 1 and len(table.entries) == len(data["entries"])
    if not table.entries:
        assert "no GPU" in table.note


def test_table_ships_as_package_data():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "tuned_configs.json" in cfg["package-data"]["pallas_kernels"]


def test_exact_lookup_normalises_the_dtype(tmp_path):
    path = write(tmp_path, [entry()])
    for dtype in (jnp.bfloat16, "bfloat16", jnp.dtype("bfloat16")):
        assert lookup(path, dtype=dtype) == dict(block_k=64, num_stages=4, num_warps=4)


def test_not_on_a_gpu_or_another_key_misses(tmp_path):
    path = write(tmp_path, [entry()])
    assert lookup(path, device_kind=None) is None
    assert lookup(path, device_kind="NVIDIA H100 80GB HBM3") is None
    assert lookup(path, dtype=jnp.float8_e4m3fn) is None
    assert lookup(path, block_size=32) is None
    assert lookup(path, kernel="ragged_paged_attention") is None
    assert lookup(path, group=8) is None  # next power of two differs: another tile
    assert lookup(path, head_dim=256) is None


def test_nearest_match_shares_the_padded_tile(tmp_path):
    cfg4 = dict(block_k=64, num_stages=4, num_warps=4)
    cfg3 = dict(block_k=32, num_stages=2, num_warps=4)
    path = write(
        tmp_path,
        [
            entry(),
            entry(group=3, config=cfg3),
            entry(head_dim=64, group=1, config=dict(block_k=128, num_stages=3, num_warps=4)),
        ],
    )
    assert lookup(path, group=3) == cfg3  # exact beats nearest
    assert lookup(path, group=4) == cfg4
    # group 3 and 4 pad to 4; head_dim 80/96 pad to 128: the padded entry wins.
    assert lookup(path, head_dim=96, group=3) == cfg3
    assert lookup(path, head_dim=80, group=4) == cfg4
    assert lookup(path, head_dim=64, group=1)["block_k"] == 128
    assert lookup(path, head_dim=48, group=1)["block_k"] == 128


def test_ragged_entry(tmp_path):
    cfg = dict(block_q=16, block_k=64, num_warps=4, num_stages=2)
    path = write(tmp_path, [entry(kernel="ragged_paged_attention", config=cfg)])
    assert lookup(path, kernel="ragged_paged_attention") == cfg
    assert lookup(path) is None


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(kernel="decode"), r"entries\[0\]\.kernel='decode' must be one of"),
        (dict(head_dim=0), r"entries\[0\]\.head_dim=0 must be a positive int"),
        (dict(group=True), r"entries\[0\]\.group=True must be a positive int"),
        (dict(device_kind=""), r"entries\[0\]\.device_kind='' must be a non-empty string"),
        (dict(config=dict(block_k=64)), r"entries\[0\]\.config keys \['block_k'\] must be exactly"),
        (
            dict(config=dict(block_k=48, num_stages=2, num_warps=4)),
            r"entries\[0\]\.config\.block_k=48 must be a power of two",
        ),
        (
            dict(config=dict(block_k=64, num_stages=0, num_warps=4)),
            r"entries\[0\]\.config\.num_stages=0 must be a positive int",
        ),
        (dict(measured=[1]), r"entries\[0\]\.measured=\[1\] must be a JSON object"),
        (dict(speed=1), r"entries\[0\] has unknown field\(s\) \['speed'\]"),
    ],
)
def test_bad_entries_name_the_field(tmp_path, bad, match):
    path = write(tmp_path, [entry(**bad)])
    with pytest.raises(ValueError, match=match):
        tuning.load_table(path)


def test_bad_tables_name_the_file_and_field(tmp_path):
    with pytest.raises(ValueError, match="format=2 must be 1"):
        tuning.load_table(write(tmp_path, [], format=2))
    (tmp_path / "u.json").write_text("{")
    with pytest.raises(ValueError, match="u.json: not valid JSON"):
        tuning.load_table(tmp_path / "u.json")
    with pytest.raises(ValueError, match=r"entries\[1\] repeats the key of entries\[0\]"):
        tuning.load_table(write(tmp_path, [entry(), entry()]))
    with pytest.raises(ValueError, match="kernel='x' must be one of"):
        tuning.tuned_config(
            "x", device_kind=H200, dtype="bfloat16", head_dim=128, group=4, block_size=16
        )


def test_write_entries_merges_replaces_and_refreshes_the_cache(tmp_path):
    path = tmp_path / "new" / "t.json"
    tuning.write_entries([entry()], path, note="n")
    assert lookup(path)["block_k"] == 64
    tuning.write_entries(
        [entry(config=dict(block_k=128, num_stages=3, num_warps=8)), entry(group=8)], path
    )
    table = tuning.load_table(path)
    assert len(table.entries) == 2 and table.note == "n"
    assert lookup(path)["block_k"] == 128  # replaced, and the cached read was dropped
    assert lookup(path, group=8)["block_k"] == 64
    data = json.loads(path.read_text())
    assert data["format"] == 1 and data["entries"][0]["measured"]["command"] == "c"
    with pytest.raises(ValueError, match="entry.head_dim=-1"):
        tuning.write_entries([entry(head_dim=-1)], path)


def test_device_kind_is_none_on_cpu_and_import_is_jax_free():
    assert tuning.current_device_kind() is None  # the test machines have no GPU backend
    code = "import sys, pallas_kernels.tuning; print('jax' in sys.modules)"
    # timeout: a hang guard only (a bare interpreter start; minutes would mean a hang).
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr
