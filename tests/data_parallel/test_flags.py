"""The data-parallel flags fail in one line, before anything loads, when they cannot work."""

from __future__ import annotations

import sys

import pytest

from paged_jax.entrypoints.generate_cli import build_parser
from paged_jax.entrypoints.generate_cli import main as generate_main


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--data-parallel-size", "0"], "--data-parallel-size=0 must be an int >= 1"),
        (["--data-parallel-size", "2", "--cpus-per-replica", "0"], "--cpus-per-replica=0 must be"),
    ],
)
def test_bad_values_exit_2_in_one_line(args, match, capsys):
    assert generate_main([*args, "--no-tqdm"]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1, err


def test_without_ray_the_error_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert generate_main(["--data-parallel-size", "2", "--no-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "--data-parallel-size needs Ray Data" in err and "pip install 'paged-jax[ray]'" in err


def test_one_replica_is_the_single_process_run():
    args = build_parser().parse_args([])
    assert (args.data_parallel_size, args.ray_address, args.cpus_per_replica) == (1, None, None)
