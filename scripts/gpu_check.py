"""Every cuda claim of issue 52 in one go, one JSON report; scripts/gpu_check.sh runs it (its header says how).

Steps (each one record in the report: ok true or false, or skipped with the reason; its seconds and figures):
  environment   python, torch (its CUDA), the device, each library's version and where it was imported from
  methods       lcsb (exact, suffix, identity) and full-backprop, in bf16 autocast and in fp32, on the device and on
                the CPU: the device's losses finite and its first steps within tolerance of the CPU's
  k1_full       lcsb K=1 equals full backprop on the device, bit for bit (deterministic algorithms on)
  resume_kill9  an `lcsb train` killed with SIGKILL after a checkpoint, then --resume: the adapter and the losses of
                the uninterrupted run, bit for bit (deterministic algorithms on)
  gguf_packed   a Q8_0 GGUF written here (gguf_out.write_gguf) trains packed on the device, its blocks on the device
                (the torch dequantizer runs there); first steps within tolerance of the CPU's
  nf4           quantization: nf4 (bitsandbytes) on the device against the CPU
  bench         `lcsb bench --compare full-backprop --compare lcsb:4:identity --compare lcsb:4:suffix` on the
                qwen2.5-0.5b shape: step times, speedups, peak memory
  cuda_test     the suite's cuda test (tests/test_engine.py -k cuda)
--dry-run: the same steps on the cpu backend, on the tiny random-init preset with fewer steps (tests/test_gpu_check.py).
--prepare DIR (here, with the package index): the wheels the GPU machine lacks, as pinned in constraints.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the wheels carried to a machine that has torch, transformers, peft, rich, typer and pyyaml: transformers and peft
# at lcsb's pins (the GGUF reader needs transformers >= 5.24, which needs huggingface_hub >= 2.4 with its httpx2, and
# checks regex's version as it loads), and what lcsb imports that the machine lacks
CARRIED = ("transformers", "huggingface_hub", "httpx2", "httpcore2", "truststore", "regex", "peft", "gguf")
CARRIED += ("rank-bm25", "bitsandbytes")
# bitsandbytes' wheel (43 MB) holds a library per CUDA release; the GPU machine's torch is built for CUDA 13.0
# (2.11.0+cu130 as last seen there): only CUDA 13's and the CPU one travel, all would push a call past its 64 MiB
BNB_KEPT = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so")
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64"]
PLATFORM += ["--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64", "--only-binary=:all:"]
VARIANTS = {
    "lcsb-exact": ("method=lcsb", "lcsb.upper_path=exact"),
    "lcsb-suffix": ("method=lcsb", "lcsb.upper_path=suffix"),
    "lcsb-identity": ("method=lcsb", "lcsb.upper_path=identity"),
    "full-backprop": ("method=full-backprop",),
}
PRECISIONS = {"bf16": "train.autocast=bf16", "fp32": "train.autocast=none"}
# relative difference of a first step's loss, device against CPU: fp32 differs in summation order only; bf16
# products round to 8 bits of mantissa on both, in different orders
TOLERANCE = {"bf16": 3e-2, "fp32": 1e-3}
COMPARED_STEPS = 3
BENCH = ("--compare", "full-backprop", "--compare", "lcsb:4:identity", "--compare", "lcsb:4:suffix")
DETERMINISTIC_MAIN = (
    "import torch; torch.use_deterministic_algorithms(True); from lcsb_cli.cli import app; app(prog_name='lcsb')"
)


@dataclass(frozen=True)
class Check:
    """What the steps run on: the device, the recipe and preset, how many steps, where runs go."""

    dry: bool
    work: Path

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def recipe(self) -> Path:
        # lamp-tiny, pretrained: losses a real task has; the dry run: the tiny random-init preset
        return REPO / ("tests/tiny.yaml" if self.dry else "recipes/lamp2.yaml")

    @property
    def preset(self) -> str:
        return "tiny-qwen2" if self.dry else "lamp-tiny"

    @property
    def steps(self) -> int:
        return COMPARED_STEPS if self.dry else 8

    @property
    def resume_steps(self) -> int:
        # a kill after the step-4 checkpoint must find the run still going: 36 steps on a GPU take about a second
        return 12 if self.dry else 40

    def overrides(self, *extra: str, steps: int | None = None) -> list[str]:
        return [
            "data.user=null",
            "overnight.report=false",
            f"train.max_steps={steps or self.steps}",
            "train.save_every=0",
            "train.log_every=1",
            f"backend={self.device}",
            *extra,
        ]


def train(check: Check, name: str, *overrides: str, steps: int | None = None) -> dict:
    """One `lcsb train` in this process: its summary and its losses."""
    from lcsb_cli.recipe import load_recipe
    from lcsb_cli.run.entry import train as train_run
    from lcsb_cli.run.hooks import SilentDisplay
    from lcsb_cli.rundir import read_metrics

    run_dir = check.work / "runs" / name
    recipe = load_recipe(check.recipe, check.overrides(*overrides, steps=steps))
    summary = train_run(recipe, run_dir, SilentDisplay(), force=True)
    losses = [row["loss"] for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row]
    return {"losses": losses, "peak_mem_mb": summary.get("peak_mem_mb"), "step_s": summary.get("median_step_time_s")}


def adapter(check: Check, name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(check.work / "runs" / name / "adapter" / "adapter_model.safetensors")


def same_tensors(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def against_cpu(check: Check, name: str, overrides: tuple[str, ...], tolerance: float) -> dict:
    """`name` trained on the device, its losses finite and its first steps within `tolerance` (relative) of the
    same run on the CPU (the dry run's device is the CPU: its own run is the reference)."""
    device_run = train(check, name, *overrides)
    cpu_run = device_run if check.dry else train(check, f"{name}-cpu", *overrides, "backend=cpu")
    pairs = list(zip(device_run["losses"][:COMPARED_STEPS], cpu_run["losses"][:COMPARED_STEPS]))
    worst = max(abs(d - c) / max(abs(c), 1e-12) for d, c in pairs)
    finite = all(map(math.isfinite, device_run["losses"]))
    ok = finite and len(pairs) == COMPARED_STEPS and worst <= tolerance
    return {"ok": ok, "max_rel_diff": worst, "tolerance": tolerance, "device": device_run, "cpu": cpu_run}


@contextlib.contextmanager
def deterministic():
    import torch

    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def environment(check: Check) -> dict:
    import torch

    found = {}
    for name in ("torch", "transformers", "peft", "huggingface_hub", "bitsandbytes", "gguf", "rank_bm25"):
        try:
            module = importlib.import_module(name)
            found[name] = {"version": getattr(module, "__version__", "?"), "from": module.__file__}
        except Exception as exc:  # a missing or broken library is a finding
            found[name] = {"error": f"{type(exc).__name__}: {exc}"}
    cuda = torch.cuda.is_available()
    return {
        "ok": cuda or check.dry,
        "python": platform.python_version(),
        "torch_cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "cpu_count": os.cpu_count(),
        "libraries": found,
    }


def methods(check: Check) -> dict:
    results = {}
    for precision, autocast in PRECISIONS.items():
        for variant, overrides in VARIANTS.items():
            name = f"{variant}-{precision}"
            results[name] = against_cpu(check, name, (*overrides, autocast), TOLERANCE[precision])
    return {"ok": all(r["ok"] for r in results.values()), "runs": results}


def k1_full(check: Check) -> dict:
    results = {}
    with deterministic():
        for precision, autocast in PRECISIONS.items():
            k1 = train(check, f"k1-{precision}", "method=lcsb", "lcsb.blocks=1", autocast)
            full = train(check, f"full-{precision}", "method=full-backprop", autocast)
            same = same_tensors(adapter(check, f"k1-{precision}"), adapter(check, f"full-{precision}"))
            results[precision] = {"ok": same and k1["losses"] == full["losses"], "k1": k1, "full": full}
    return {"ok": all(r["ok"] for r in results.values()), **results}


def resume_kill9(check: Check) -> dict:
    """Killed once its step-4 checkpoint is on disk, a run (checkpoints every 2 steps) is resumed."""
    overrides = check.overrides("train.save_every=2", "train.autocast=bf16", steps=check.resume_steps)
    killed = check.work / "runs" / "killed"
    command = [sys.executable, "-c", DETERMINISTIC_MAIN, "train", str(check.recipe), *overrides, "-o", str(killed)]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not (killed / "checkpoints" / "step-4").is_dir() and proc.poll() is None:
        time.sleep(0.01)
    running = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    stderr = proc.communicate()[1]
    if not running:
        return {"ok": False, "error": f"the run ended before the kill (exit {proc.returncode}): {stderr[-2000:]}"}
    resumed = subprocess.run([*command, "--resume"], cwd=REPO, capture_output=True, text=True)
    if resumed.returncode != 0:
        return {"ok": False, "error": f"--resume exited {resumed.returncode}: {resumed.stderr[-2000:]}"}
    with deterministic():
        whole = train(check, "whole", "train.autocast=bf16", steps=check.resume_steps)
    from lcsb_cli.rundir import read_metrics

    losses = [row["loss"] for row in read_metrics(killed / "metrics.jsonl") if "loss" in row]
    same = same_tensors(adapter(check, "killed"), adapter(check, "whole"))
    return {
        "ok": same and losses == whole["losses"],
        "adapter_identical": same,
        "losses_equal": losses == whole["losses"],
    }


def gguf_packed(check: Check) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from lcsb_cli.model.gguf import write as gguf_out
    from lcsb_cli.model.gguf.linear import PackedLinear
    from lcsb_cli.model.load import resolve_base_dir
    from lcsb_cli.recipe import load_recipe
    from lcsb_cli.run.engine import build_trainer

    base_dir = resolve_base_dir(check.preset)
    path = check.work / f"{check.preset}-q8_0.gguf"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    gguf_out.write_gguf(model, base_dir, path, "q8_0", None)
    packed = (f"model.name={path}", "quantization=gguf", "train.autocast=none")
    trainer, loaded, _ = build_trainer(load_recipe(check.recipe, check.overrides(*packed)))
    layers = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    where = sorted({m.weight.device.type for m in layers})
    del trainer, loaded
    result = against_cpu(check, "gguf", packed, TOLERANCE["fp32"])
    return {**result, "ok": result["ok"] and where == [check.device], "packed_layers": len(layers), "blocks_on": where}


def nf4(check: Check) -> dict:
    try:
        import bitsandbytes
    except Exception as exc:  # the skip names why
        return {"skipped": f"bitsandbytes does not import ({type(exc).__name__}: {exc})"}
    # fp32 products of the same 4-bit codes; the two quantize the weights with their own kernels
    result = against_cpu(check, "nf4", ("quantization=nf4", "train.autocast=none"), 1e-2)
    return {**result, "bitsandbytes": bitsandbytes.__version__}


def bench(check: Check) -> dict:
    out = check.work / "bench"
    shape = ["model.name=tiny-qwen2", "--steps", "2", "--warmup", "1"] if check.dry else ["model.name=qwen2.5-0.5b"]
    command = [sys.executable, "-m", "lcsb_cli", "bench", str(REPO / "recipes/bench.yaml"), f"backend={check.device}"]
    proc = subprocess.run([*command, *shape, *BENCH, "-o", str(out)], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"ok": False, "error": f"lcsb bench exited {proc.returncode}: {proc.stderr[-3000:]}"}
    result = json.loads((out / "bench.json").read_text())
    keys = ("median_step_time_s", "speedup", "peak_mem_mb", "median_forward_s", "median_backward_s", "compute_dtype")
    table = {m["name"]: {k: m.get(k) for k in keys} for m in result["methods"]}
    return {"ok": True, "methods": table, "bench_json": result, "bench_md": (out / "bench.md").read_text()}


def cuda_test(check: Check) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_engine.py", "-k", "cuda"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    # on the CPU the test skips itself; on a GPU it must pass
    expected = "1 skipped" if check.dry else "1 passed"
    return {"ok": proc.returncode == 0 and expected in last, "pytest": last, "output": proc.stdout[-3000:]}


STEPS = {
    "environment": environment,
    "methods": methods,
    "k1_full": k1_full,
    "resume_kill9": resume_kill9,
    "gguf_packed": gguf_packed,
    "nf4": nf4,
    "bench": bench,
    "cuda_test": cuda_test,
}


def run_steps(check: Check, names: list[str], report_path: Path) -> dict:
    """Each step in turn, the report rewritten after each (a run cut short keeps what it did)."""
    from transformers.utils import logging as transformers_logging

    # the in-process runs' "Loading weights" bars
    transformers_logging.disable_progress_bar()
    report = {"issue": 52, "dry_run": check.dry, "backend": check.device, "started": time.strftime("%FT%T%z")}
    report["steps"] = {}
    started = time.perf_counter()
    for name in names:
        begun = time.perf_counter()
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        try:
            record = STEPS[name](check)
        except Exception as exc:  # one step's failure is its record; the others still run
            record = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        record["seconds"] = round(time.perf_counter() - begun, 2)
        report["steps"][name] = record
        verdict = "skipped" if "skipped" in record else "ok" if record["ok"] else "FAILED"
        print(f"gpu_check: {name} {verdict} in {record['seconds']} s", file=sys.stderr, flush=True)
        report["ok"] = all(r.get("ok", True) for r in report["steps"].values())
        report["wall_s"] = round(time.perf_counter() - started, 2)
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def prepare(dest: Path) -> None:
    """Download CARRIED at constraints.txt's pins for the GPU machine's Python, then thin bitsandbytes' wheel."""
    pins = dict(
        line.strip().split("==") for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line
    )
    wanted = [f"{name}=={pins[name]}" for name in CARRIED]
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(dest), *wanted]
    subprocess.run(download, check=True)
    for wheel in dest.glob("bitsandbytes-*.whl"):
        thin_bitsandbytes(wheel)
    sizes = {p.name: round(p.stat().st_size / 2**20, 1) for p in sorted(dest.glob("*.whl"))}
    print(json.dumps({"wheels_mib": sizes, "total_mib": round(sum(sizes.values()), 1)}, indent=2))


def thin_bitsandbytes(wheel: Path) -> None:
    """The wheel without the native libraries of other CUDA, ROCm and XPU releases (and their RECORD lines)."""
    thin = wheel.with_suffix(".thin")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(thin, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if _dropped(item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                kept = [line for line in lines if not _dropped(line.split(",")[0])]
                data = ("\n".join(kept) + "\n").encode()
            target.writestr(item, data)
    thin.replace(wheel)


def _dropped(path: str) -> bool:
    name = Path(path).name
    return name.startswith("libbitsandbytes_") and name not in BNB_KEPT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the cpu backend, small")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check", help="where the runs go")
    parser.add_argument("--report", type=Path, help="the JSON report (default: OUT/gpu_check.json)")
    parser.add_argument("--only", help=f"comma-separated steps of: {', '.join(STEPS)}")
    parser.add_argument("--prepare", type=Path, metavar="DIR", help="download the carried wheels into DIR")
    args = parser.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return 0
    names = args.only.split(",") if args.only else list(STEPS)
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        parser.error(f"--only: unknown step {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    report = run_steps(Check(args.dry_run, args.out), names, args.report or args.out / "gpu_check.json")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
