"""Write the synthetic LaMP-2 sample (official time-based layout) into recipes/data/lamp2/.

Deterministic: the same --seed always gives byte-identical files.
Usage: python tools/build/make_lamp2_sample.py [--out DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from synthetic import corpus_lines, write_lamp2_sample  # noqa: E402,F401  (corpus_lines re-exported)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "recipes" / "data" / "lamp2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_lamp2_sample(args.out, args.seed):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
