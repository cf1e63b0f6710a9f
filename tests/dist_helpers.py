"""Helpers to run tests/distributed/worker.py under torchrun and read what each rank wrote."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import torch
import warm_launcher

WORKER = pathlib.Path(__file__).resolve().parent / "distributed" / "worker.py"


# The variables torch.distributed reads a process's place from (launchers set them).
TORCH_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*TORCH_VARIABLES, "GLOO_SOCKET_IFNAME")}
    # One thread per process: two processes share this machine's two cores.
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})
    return env


def run_bounded(
    command: list[str], timeout: float, env: dict[str, str], cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """Run in a new session; on timeout kill the whole group, workers included."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        cwd=cwd,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"{' '.join(command)} did not finish in {timeout} s:\n"
            f"{stdout[-3000:]}\n{stderr[-5000:]}"
        ) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


class _Cold:
    """The commands themselves, for HAPI_TESTS_COLD=1: every process started cold."""

    @staticmethod
    def python(argv, timeout, env, cwd):
        try:
            done = run_bounded([sys.executable, *map(str, argv)], timeout, env, cwd=cwd)
        except AssertionError as error:
            return -9, str(error), "", True
        return done.returncode, done.stdout, done.stderr, False

    @staticmethod
    def torchrun(args, timeout, env, cwd):
        return _Cold.python(["-m", "torch.distributed.run", *args], timeout, env, cwd)


def _launcher():
    """The warm launcher, or with HAPI_TESTS_COLD=1 in the environment, the commands (to
    check now and then that nothing passes only because processes are forked)."""
    return _Cold if os.environ.get("HAPI_TESTS_COLD") == "1" else warm_launcher.server(child_env())


def torchrun_command() -> str:
    """A command line that stands in for ``torchrun`` where a script the tests run starts it
    (examples/multi_machine.sh's TORCHRUN): its agents and workers are forked warm."""
    launcher = _launcher()
    if launcher is _Cold:
        return f"{sys.executable} -m torch.distributed.run"
    client = pathlib.Path(__file__).resolve().parent / "warm_torchrun.py"
    launcher.wait_ready()
    return f"{sys.executable} {client} {launcher.socket}"


def torchrun(
    args: list[str],
    timeout: float = 180,
    check: bool = True,
    cwd: str | os.PathLike | None = None,
    **env: str,
):
    """``torchrun *args``, its agent and workers forked from a warm interpreter (see
    warm_launcher)."""
    command = [sys.executable, "-m", "torch.distributed.run", *args]
    launch_env = child_env(**env)
    returncode, stdout, stderr, timed_out = _launcher().torchrun(
        args, timeout, launch_env, cwd=cwd or os.getcwd()
    )
    if timed_out:
        raise AssertionError(
            f"{' '.join(command)} did not finish in {timeout} s:\n{stdout[-3000:]}\n{stderr[-5000:]}"
        )
    result = subprocess.CompletedProcess(command, returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} failed ({result.returncode}):\n"
            f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


def run_python(
    argv: list, timeout: float, env: dict[str, str], cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """``python *argv`` (argv[0]: a script) as :func:`run_bounded` runs it, forked from a
    warm interpreter (see warm_launcher); a timeout kills it with everything it started."""
    command = [sys.executable, *map(str, argv)]
    returncode, stdout, stderr, timed_out = _launcher().python(
        argv, timeout, env, cwd=cwd or os.getcwd()
    )
    if timed_out:
        raise AssertionError(
            f"{' '.join(command)} did not finish in {timeout} s:\n{stdout[-3000:]}\n{stderr[-5000:]}"
        )
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


def main_process_report(stdout: str) -> dict:
    """The one JSON line an example prints on the main process only (asserted: exactly one)."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


def read_ranks(out: pathlib.Path, scenario: str, world_size: int) -> list[dict]:
    return [json.loads((out / f"{scenario}.rank{r}.json").read_text()) for r in range(world_size)]


def assert_close_lists(a, b, atol=1e-5):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)


def single_process_weights() -> list[float]:
    """The worker's training on one process at twice the per-process batch (16)."""
    sys.path.insert(0, str(WORKER.parent))
    import worker  # noqa: PLC0415

    x, y = worker.make_tiny_data(worker.TRAIN_SAMPLES)
    model = worker.sgd_model()
    model.fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)
    return worker.flat_weights(model)


def two_machines(
    port: int,
    rdzv_id: str,
    script_args: list[list[str]],
    options: tuple[str, ...] = (),
    timeout: float = 180,
    **env: str,
) -> list[str]:
    """Two torchrun agents, one process each, meeting through a c10d rendezvous on
    127.0.0.1 as two machines would; node N runs ``script_args[N]``. Returns their
    outputs (stdout, then stderr) once both have exited with 0."""
    launcher = _launcher()
    args = [
        [
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node-rank={node}",
            *options,
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={rdzv_id}",
            *arguments,
        ]
        for node, arguments in enumerate(script_args)
    ]
    if launcher is _Cold:
        agents = [
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *node_args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=child_env(**env),
                start_new_session=True,
            )
            for node_args in args
        ]
        try:
            outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
        finally:
            for agent in agents:
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGKILL)
        returncodes = [agent.returncode for agent in agents]
    else:
        launches = [
            launcher.start("torchrun", node_args, child_env(**env), os.getcwd())
            for node_args in args
        ]
        deadline = time.monotonic() + timeout
        done = [launcher.wait(launch, max(deadline - time.monotonic(), 1)) for launch in launches]
        returncodes = [returncode for returncode, _, _, _ in done]
        outputs = [stdout + stderr for _, stdout, stderr, _ in done]
    assert returncodes == [0, 0], outputs
    return outputs
