"""One writer per run directory: a second `lcsb train` (resume or force) or an `lcsb eval` into a run that another
process is writing is refused with exit 2 and one line naming that process; a killed writer leaves no lock
behind, so the next --resume goes on."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import LAMP2, REPO, cli, lcsb, run_train

from lcsb_cli.rundir.checkpoint import checkpoint_dirs, step_of

ARGS = ["train", str(LAMP2), "train.max_steps=100000", "train.save_every=5", "train.log_every=1"]


def wait_for_checkpoint(run, writer, timeout=180):
    deadline = time.monotonic() + timeout
    while not checkpoint_dirs(run / "checkpoints"):
        assert writer.poll() is None, writer.communicate()[1]
        assert time.monotonic() < deadline, "the first writer made no checkpoint"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_second_writer_is_refused_and_a_killed_writer_blocks_nothing(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    writer = subprocess.Popen(
        [sys.executable, "-m", "lcsb_cli", *ARGS, "--output", str(run)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_checkpoint(run, writer)
        for second in (lcsb(*ARGS, "--output", str(run), "--resume"), lcsb(*ARGS, "--output", str(run), "--force")):
            lines = second.stderr.splitlines()
            assert second.returncode == 2 and len(lines) == 1, second.stderr
            assert f"process {writer.pid} is writing this run" in lines[0], lines[0]
        # the refused commands left the writer and its run alone
        assert writer.poll() is None
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    last = step_of(checkpoint_dirs(run / "checkpoints")[0])
    resumed = lcsb(*ARGS[:2], f"train.max_steps={last + 2}", *ARGS[3:], "--output", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert (run / "summary.json").is_file() and (run / "adapter" / "adapter_config.json").is_file()


HOLD = (
    "import sys, time; from lcsb_cli.rundir import RunDir\n"
    "with RunDir(sys.argv[1]).writer():\n    print('held', flush=True); time.sleep(600)"
)


def test_an_eval_into_a_run_being_written_is_refused_before_it_evaluates(tmp_path):
    run = tmp_path / "run"
    run_train(run, "train.max_steps=1")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = cli("eval", str(run))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"process {holder.pid} is writing this run" in proc.stderr
        assert not (run / "eval.json").exists()
    finally:
        holder.kill()
        holder.wait()
    # the lock went with its process
    assert cli("eval", str(run)).returncode == 0
    assert (run / "eval.json").is_file()
