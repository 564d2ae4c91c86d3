"""Training-step times of the engine's own Trainer in one process, for knobs `lcsb bench` does not turn: the SDPA
backend (PyTorch's CPU flash kernel, its default, or the math path of plain matrix products) and a busy loop on one
core beside the step (a machine shared with other work). OpenMP's settings come from the environment as in any
lcsb process (lcsb sets OMP_WAIT_POLICY=PASSIVE unless the environment sets it; libgomp's GOMP_SPINCOUNT applies).

    python tools/measure/step_times.py recipes/bench-smollm2.yaml method=full-backprop --sdpa math
    GOMP_SPINCOUNT=10000 python tools/measure/step_times.py recipes/bench-smollm2.yaml --busy
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys

# lcsb_cli first: it sets OpenMP's wait policy, which libgomp reads when torch loads it
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.engine import build_trainer

# isort: split
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE recipe overrides")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--sdpa", choices=sorted(BACKENDS), default="flash")
    parser.add_argument("--busy", action="store_true", help="a busy loop on one core while the steps run")
    args = parser.parse_intermixed_args()
    trainer, _, _ = build_trainer(load_recipe(args.recipe, args.overrides))
    trainer.begin()
    with contextlib.ExitStack() as stack:
        if args.busy:
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            stack.callback(busy.kill)
        stack.enter_context(sdpa_kernel(BACKENDS[args.sdpa]))
        times = [trainer.step(step)["step_time_s"] for step in range(args.steps)]
    print(
        f"{' '.join(args.overrides)} sdpa={args.sdpa}{' busy' if args.busy else ''}: "
        f"steps {' '.join(f'{t:.2f}' for t in times)} s; median after {args.warmup}: "
        f"{statistics.median(times[args.warmup :]):.3f} s"
    )


if __name__ == "__main__":
    main()
