"""How far `lcsb train` is from `optimizer.step()` (issue 49): the project's files and functions on the call stack at
the first optimizer step, and every project function called before it (the set-up included).

    python tools/measure/call_path.py [KEY=VALUE ...]

Runs `lcsb train recipes/lamp2.yaml data.user=null train.max_steps=1` in this process (the CLI's own app) into a
scratch directory and prints one JSON line. Point PYTHONPATH at another checkout to measure it the same way."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

import lcsb_cli

PACKAGE = str(Path(lcsb_cli.__file__).resolve().parent)
REPO = Path(PACKAGE).parent


def _own(frame) -> tuple[str, str] | None:
    path = frame.f_code.co_filename
    if not path.startswith(PACKAGE):
        return None
    return str(Path(path).relative_to(PACKAGE)), frame.f_code.co_qualname


def main(overrides: list[str]) -> None:
    from lcsb_cli.cli import app

    before: set[tuple[str, str]] = set()
    stack: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call" or stack:
            return
        own = _own(frame)
        if own is not None:
            before.add(own)
        if isinstance(frame.f_locals.get("self"), torch.optim.Optimizer) and frame.f_code.co_name == "step":
            caller = frame.f_back
            while caller is not None:
                if (own := _own(caller)) is not None:
                    stack.append(own)
                caller = caller.f_back

    out = tempfile.mkdtemp(prefix="call-path-")
    args = ["train", str(REPO / "recipes" / "lamp2.yaml"), "data.user=null", "train.max_steps=1", *overrides]
    sys.setprofile(profile)
    try:
        app([*args, "--output", out], standalone_mode=False)
    finally:
        sys.setprofile(None)
    print(
        json.dumps(
            {
                "stack_files": len({f for f, _ in stack}),
                "stack_functions": len(stack),
                "stack": [f"{f}:{name}" for f, name in reversed(stack)],
                "setup_files": len({f for f, _ in before}),
                "setup_functions": len(before),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
