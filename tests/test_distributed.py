"""Data parallel on torch.distributed: gloo, CPU processes via `lcsb train --nproc 2`, and two "nodes" of one
process each on the loopback (`--nnodes 2`, a c10d rendezvous on 127.0.0.1)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
from helpers import LAMP2, REPO, adapter_tensors, assert_one_line_error, assert_same_tensors, cli

from lcsb_cli import rundir
from lcsb_cli.errors import BadInput
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.distributed import Nodes

COMMON = ("train.max_steps=4", "train.save_every=2", "train.log_every=1", "train.lr_scheduler=constant")
# one thread a process on every topology: a product's bits may depend on the thread count
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def lcsb(*args):
    return subprocess.run(
        [sys.executable, "-m", "lcsb_cli", *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600
    )


def errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error:" in line] or proc.stderr[-1000:].splitlines()


def steps(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def lora_bytes_per_layer(run_dir):
    tensors = adapter_tensors(run_dir)
    return sum(t.numel() * 4 for k, t in tensors.items() if ".layers.0." in k), sum(".layers.0." in k for k in tensors)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_two_nodes(*args: str) -> list[subprocess.Popen]:
    """`lcsb train ARGS` as two nodes of one process each. The first node hosts the c10d store (the second starts
    once its port listens), so the second is the one a test may kill without taking the rendezvous with it."""
    port = free_port()
    flags = ("--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t")
    command = [sys.executable, "-m", "lcsb_cli", "train", str(LAMP2), *args, *flags]
    first = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not listens(port):
        assert first.poll() is None and time.time() < deadline, first.communicate()
        time.sleep(0.2)
    second = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return [first, second]


def finish(nodes: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    done = []
    for node in nodes:
        out, err = node.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return done


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL a node: torchrun's agent and its workers (each in a session of its own)."""
    for process in [*psutil.Process(node.pid).children(recursive=True), psutil.Process(node.pid)]:
        process.kill()
    node.communicate()


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_the_global_batch_and_send_only_the_active_block(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    proc = lcsb("train", str(LAMP2), *COMMON, "train.batch_size=2", "--nproc", "2", "--output", str(two))
    assert proc.returncode == 0, errors(proc)
    assert cli("train", str(LAMP2), *COMMON, "train.batch_size=4", "--output", str(one)).returncode == 0
    a, b = adapter_tensors(one), adapter_tensors(two)
    assert a.keys() == b.keys()
    for key in a:
        # fp32 reduction order only; AdamW turns a 1e-7 gradient difference into up to ~lr * 1e-2 on a weight
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=2e-5)
    for single, data_parallel in zip(steps(one), steps(two)):
        assert abs(single["loss"] - data_parallel["loss"]) < 1e-5 and single["tokens"] == data_parallel["tokens"]
    # tiny-qwen2 with K=4: one layer a block
    block_bytes, block_tensors = lora_bytes_per_layer(one)
    assert [(r["comm_tensors"], r["comm_bytes"]) for r in steps(two)] == [(block_tensors, block_bytes)] * 4
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2
    assert not (two / "checkpoints" / "step-4" / "rank-1").exists() and len(list(two.glob("adapter*"))) == 1

    # the N=2 run as it was at its step-2 checkpoint
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    refused = cli("train", str(LAMP2), *COMMON, "train.batch_size=2", "--output", str(resumed), "--resume")
    assert refused.returncode == 2 and "resume with --nproc 2" in refused.stderr
    proc = lcsb(
        "train", str(LAMP2), *COMMON, "train.batch_size=2", "--nproc", "2", "--output", str(resumed), "--resume"
    )
    assert proc.returncode == 0, errors(proc)
    assert_same_tensors(adapter_tensors(two), adapter_tensors(resumed))
    assert [r["loss"] for r in steps(two)] == [r["loss"] for r in steps(resumed)]


@pytest.mark.slow
def test_two_nodes_equal_one_node_of_two_processes_and_a_killed_node_resumes_exactly(tmp_path):
    """Two nodes of one process against one node of two, bit for bit: the same two ranks, each on its shard of every
    global batch, and the same sum of two gradients (fp32 addition commutes, so which node gets rank 0 does not
    matter). The two-node run loses a node after its step-2 checkpoint and is resumed on both."""
    args = ("train.max_steps=40", "train.save_every=2", "train.log_every=1", "train.batch_size=2")
    one, two = tmp_path / "one", tmp_path / "two"
    proc = lcsb("train", str(LAMP2), *args, "--nproc", "2", "--output", str(one))
    assert proc.returncode == 0, errors(proc)

    first, second = start_two_nodes(*args, "--output", str(two))
    while not (two / "checkpoints" / "step-2").is_dir():
        assert first.poll() is None and second.poll() is None, finish([first, second])
        time.sleep(0.05)
    kill_node(second)
    survivor = finish([first])[0]
    assert not (two / "summary.json").exists()
    assert survivor.returncode == 1 and "Traceback" not in survivor.stderr, survivor.stderr
    (line,) = [line for line in survivor.stderr.splitlines() if line.startswith("error:")]
    assert "lost the other ranks" in line and "--resume" in line, line

    for node in finish(start_two_nodes(*args, "--output", str(two), "--resume")):
        assert node.returncode == 0, errors(node)
    assert_same_tensors(adapter_tensors(one), adapter_tensors(two))
    assert [r["loss"] for r in steps(one)] == [r["loss"] for r in steps(two)]
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_ctrl_c_reaches_every_rank_through_the_launcher_and_exits_130(tmp_path):
    run = tmp_path / "run"
    args = ("train.max_steps=400", "train.save_every=2", "train.batch_size=2", "--nproc", "2", "-o", str(run))
    command = [sys.executable, "-m", "lcsb_cli", "train", str(LAMP2), *args]
    launcher = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (run / "checkpoints" / "step-2").is_dir():
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    _, stderr = launcher.communicate(timeout=300)
    summary = json.loads((run / "summary.json").read_text())
    assert launcher.returncode == 130 and "stopped by SIGINT; continue with --resume" in stderr, stderr
    assert summary["stopped"] == "SIGINT" and (run / "checkpoints" / f"step-{summary['steps']}").is_dir()


def _five_users(tmp_path):
    """The sample's questions and golds of its first five users."""
    data = REPO / "recipes" / "data" / "lamp2"
    questions = json.loads((data / "dev_questions.json").read_text())
    keep = sorted({q["user_id"] for q in questions})[:5]
    questions = [q for q in questions if q["user_id"] in keep]
    ids = {q["id"] for q in questions}
    golds = json.loads((data / "dev_outputs.json").read_text())
    golds["golds"] = [g for g in golds["golds"] if g["id"] in ids]
    (tmp_path / "q.json").write_text(json.dumps(questions))
    (tmp_path / "o.json").write_text(json.dumps(golds))
    return keep, (f"data.eval={tmp_path / 'q.json'}", f"data.eval_labels={tmp_path / 'o.json'}")


@pytest.mark.slow
def test_per_user_runs_are_split_across_the_ranks_of_two_nodes(tmp_path):
    keep, data = _five_users(tmp_path)
    run = tmp_path / "users"
    nodes = finish(start_two_nodes(*data, "data.user=all", "train.max_steps=2", "train.save_every=0", "-o", str(run)))
    for node in nodes:
        assert node.returncode == 0, errors(node)
    assert sorted(p.name for p in (run / "users").iterdir()) == keep
    assert sorted(p.name for p in (run / "adapters").iterdir()) == keep
    summary = json.loads((run / "summary.json").read_text())
    assert summary["users"] == 5 and summary["steps"] == 10 and "stopped" not in summary


def test_node_flags_reach_torchrun_as_given():
    assert Nodes().torchrun_flags(2) == ["--standalone", "--nproc-per-node=2"]
    assert Nodes(2, None, "node0:29400", "job7").torchrun_flags(4) == [
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29400",
        "--rdzv-id=job7",
    ]
    static = Nodes(2, 1, "node0:29400", backend="static").torchrun_flags(1)
    assert "--rdzv-backend=static" in static and static[-1] == "--node-rank=1"


@pytest.mark.parametrize(
    "flags,needles",
    [
        (["--nnodes", "2"], ["--nnodes 2", "--rdzv-endpoint HOST:PORT"]),
        (["--nnodes", "2", "--rdzv-endpoint", "node0"], ["--rdzv-endpoint 'node0'", "HOST:PORT"]),
        (["--nnodes", "2", "--rdzv-endpoint", "n:1", "--node-rank", "2"], ["--node-rank 2", "0 to 1"]),
    ],
)
def test_bad_node_flags_are_one_line_before_any_process_starts(tmp_path, flags, needles):
    proc = cli("train", str(LAMP2), *flags, "--output", str(tmp_path / "r"))
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "r").exists()


class _SecondRank:
    rank, size, is_main = 1, 2, False

    def barrier(self):
        pass


def test_a_rank_that_does_not_see_rank_0s_run_dir_stops_in_one_line(tmp_path):
    """Rank 0 on another node wrote its run dir where this rank cannot see it: not one shared directory."""
    recipe = load_recipe(LAMP2, [])
    opened = rundir.opened_run(tmp_path / "run", recipe, False, False, _SecondRank(), lambda: (None, 0))
    with pytest.raises(BadInput, match="rank 1 does not see the run dir rank 0 wrote.*every node shares"), opened:
        pass
