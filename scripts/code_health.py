"""How readable the tree is, in numbers: files on one request's path, import circles,
cross-module private reads, duplicated constants. Prints and saves JSON.

python scripts/code_health.py --out docs/code_health.json
python scripts/code_health.py --root /some/other/checkout --no-trace   # static figures only

Files on a request's path are measured, not listed by hand: one `LLM.generate` call of
one prompt on the demo model (no warm-up, so the jitted step is traced and its model and
kernel code runs) under `sys.setprofile`, counting the project files whose code ran
(`num_request_path_files`; `num_request_path_files_paged_jax` leaves out models/ and
pallas_kernels/). A module of data only (types, constants) counts when a function of
it runs, not when its dataclasses are built.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys

from paged_jax.testing.code_structure import (
    PROJECT_PACKAGES,
    collect_modules,
    import_cycles,
    import_graph,
    private_reads,
)

# A module-level UPPER_CASE assignment: a named constant.
CONSTANT = re.compile(r"^([A-Z][A-Z0-9_]+)\s*(?::[^=]+)?=", re.M)
INLINE_CDIV = re.compile(r"-\(-[^)]*//")
CDIV_DEF = re.compile(r"def _?cdiv\(")


def static_figures(root: pathlib.Path) -> dict:
    """Import circles, private reads and duplicated-constant sites of the checkout at root."""
    modules = collect_modules(root, PROJECT_PACKAGES)
    owners = list(modules.values())
    code_files = [m.path for m in owners]
    for folder in ("scripts", "examples"):
        code_files += sorted((root / folder).glob("*.py"))
    test_files = sorted((root / "tests").rglob("*.py"))
    reads = private_reads(code_files, owners)
    definitions: dict[str, list[str]] = collections.defaultdict(list)
    inline_cdiv: list[str] = []
    for path in code_files:
        text = path.read_text()
        rel = str(path.relative_to(root))
        for name in CONSTANT.findall(text):
            definitions[name].append(rel)
        lines = text.splitlines()
        for i, line in enumerate(lines, 1):
            # The body of a cdiv helper (its def one or two lines up) is that helper.
            above = lines[max(0, i - 3) : i - 1]
            if INLINE_CDIV.search(line) and not any(CDIV_DEF.search(x) for x in above):
                inline_cdiv.append(f"{rel}:{i}")
    duplicated = {k: v for k, v in sorted(definitions.items()) if len(v) > 1}
    cycles = import_cycles(import_graph(modules))
    return {
        "num_modules": len(modules),
        "import_cycles": cycles,
        "num_import_cycles": len(cycles),
        "private_reads": [str(r).replace(str(root) + "/", "") for r in reads],
        "num_private_reads": len(reads),
        "num_private_reads_in_tests": len(private_reads(test_files, owners)),
        "constants_defined_in_several_modules": duplicated,
        "inline_ceiling_divisions": inline_cdiv,
        "num_duplicated_constant_sites": sum(len(v) for v in duplicated.values())
        + len(inline_cdiv),
    }


def request_path_files(root: pathlib.Path) -> list[str]:
    """Project files whose code runs during one LLM.generate of one prompt (demo model)."""
    from paged_jax import LLM, SamplingParams
    from paged_jax.entrypoints.demo import ensure_demo_model

    llm = LLM(str(ensure_demo_model()), warmup=False, max_num_seqs=8, max_num_batched_tokens=64)
    seen: set[str] = set()

    def profile(frame, event, arg):
        del arg
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        llm.generate(["Hello paged attention"], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        sys.setprofile(None)
    roots = [(root / folder).resolve() for folder in PROJECT_PACKAGES]
    files = {pathlib.Path(f).resolve() for f in seen if f.endswith(".py")}
    return sorted(
        str(f.relative_to(root.resolve())) for f in files if any(r in f.parents for r in roots)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=str(pathlib.Path(__file__).resolve().parent.parent))
    p.add_argument("--no-trace", action="store_true", help="skip the request-path trace")
    p.add_argument("--out", help="write the JSON here")
    args = p.parse_args(argv)
    root = pathlib.Path(args.root)
    figures = static_figures(root)
    if not args.no_trace:
        files = request_path_files(root)
        figures["request_path_files"] = files
        figures["num_request_path_files"] = len(files)
        figures["num_request_path_files_paged_jax"] = sum(f.startswith("paged_jax/") for f in files)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
