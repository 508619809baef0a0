"""Memory study for sliding-window recycling: blocks held per request vs context length.

    python scripts/bench_window_memory.py --output docs/window_memory.json \
        --figure docs/figures/memory/window_groups.png

Prints a table, saves the JSON and the figure. Host side only (no jax).
"""

from __future__ import annotations

import argparse
import json
import pathlib

from paged_jax.memory_study.window_groups import plot, study


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=26)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (token budget)")
    parser.add_argument("--table-lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument(
        "--record-every", type=int, default=64, help="curve resolution (table lengths: multiples)"
    )
    parser.add_argument("--output", type=pathlib.Path, default=None)
    parser.add_argument("--figure", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    result = study(
        num_layers=args.num_layers,
        window=args.window,
        block_size=args.block_size,
        prompt_len=args.prompt_len,
        max_len=args.max_len,
        chunk=args.chunk,
        record_every=args.record_every,
        table_lengths=[n for n in args.table_lengths if args.prompt_len < n <= args.max_len],
    )
    names = list(result["variants"])
    print("context | " + " | ".join(f"{n}: blocks (bytes vs full)" for n in names))
    for row in result["table"]:
        cells = [f"{row[n]['blocks_held']} ({row[n]['kv_bytes_vs_full']:.2f})" for n in names]
        print(f"{row['context_len']} | " + " | ".join(cells))
    for n in names:
        v = result["variants"][n]
        print(f"{n}: {v['num_tensors']} KV tensors, bound {v['bound_after_prefill']} blocks")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    if args.figure:
        args.figure.parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.figure)
    return result


if __name__ == "__main__":
    main()
