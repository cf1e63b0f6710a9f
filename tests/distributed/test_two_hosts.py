"""Two real hosts, not two agents on 127.0.0.1: a torchrun job across two network namespaces.

Each host (tests/hosts.py) resolves its own name to 127.0.1.1, as Debian and
Ubuntu do, and the c10d rendezvous is at host A's name. So on host A,
MASTER_ADDR names a loopback address, which host B can never reach: rank 0
must publish its store, and Gloo must listen, at host A's veth address.
"""

from __future__ import annotations

import ipaddress
import json
import sys
import time

import pytest
import torch
from dist_helpers import WORKER, child_env
from hosts import run_on_hosts, two_hosts

SCRIPT = WORKER.parent / "two_hosts_script.py"
KILL_AT_STEP = (
    7  # the backup is every 3 optimizer steps: step 7 (mid-epoch 1 of 4 steps) is done twice
)
TIMEOUT_S = (
    150  # a few seconds of training; HAPI_DIST_TIMEOUT below bounds any wait for the other host
)


@pytest.fixture(scope="module")
def hosts():
    with two_hosts() as pair:
        yield pair


def _torchrun_on_both(hosts, directories, port, rdzv_id, *args, options=(), **env):
    """One torchrun agent per host, one process each, meeting at ``hosta:port``; returns (outputs, seconds)."""
    a, _ = hosts
    jobs = [
        (
            host,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=1",
                *options,
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={a.name}:{port}",
                f"--rdzv-id={rdzv_id}",
                str(SCRIPT),
                str(directory),
                *map(str, args),
            ],
        )
        for host, directory in zip(hosts, directories)
    ]
    started = time.monotonic()
    results = run_on_hosts(jobs, TIMEOUT_S, child_env(HAPI_DIST_TIMEOUT="20", **env))
    seconds = time.monotonic() - started
    outputs = [result.stdout for result in results]
    assert [result.returncode for result in results] == [0, 0], "\n".join(
        f"--- {host.name}:\n{output[-5000:]}" for host, output in zip(hosts, outputs)
    )
    return outputs, seconds


def _results(directories):
    """{rank: result} from the hosts' directories (no shared file system: each host writes its own)."""
    results = {}
    for directory in directories:
        (written,) = directory.glob("result.rank*.json")  # one process per host
        results[int(written.stem.removeprefix("result.rank"))] = json.loads(written.read_text())
    return results


def _max_difference(weights, reference):
    return float((torch.tensor(weights) - torch.tensor(reference)).abs().max())


@pytest.fixture(scope="module")
def uninterrupted(hosts, tmp_path_factory):
    root = tmp_path_factory.mktemp("two_hosts")
    directories = [root / host.name for host in hosts]
    for directory in directories:
        directory.mkdir()
    outputs, seconds = _torchrun_on_both(hosts, directories, 29401, "hapi-two-hosts")
    print(f"\ntwo hosts, training: {seconds:.1f} s wall")
    return _results(directories), outputs


def test_training_on_two_hosts_equals_one_process_at_the_global_batch(
    hosts, uninterrupted, tmp_path
):
    sys.path.insert(0, str(SCRIPT.parent))
    import two_hosts_script  # noqa: PLC0415

    results, _ = uninterrupted
    one_process = two_hosts_script.train(tmp_path, 2 * two_hosts_script.BATCH_PER_PROCESS)
    for rank in (0, 1):
        difference = _max_difference(results[rank]["weights"], one_process["weights"])
        print(
            f"two hosts, rank {rank} vs one process at the global batch: max |dw| = {difference:.2e}"
        )
        assert difference < 1e-5
    assert results[0]["step"] == one_process["step"]


def test_rank_0_publishes_an_address_the_other_host_reaches(hosts, uninterrupted):
    a, b = hosts
    results, _ = uninterrupted
    assert (
        results[0]["host"] == a.name
    )  # rank 0 ran where MASTER_ADDR resolves to loopback: the trap
    published_hosts = results[0]["published"].split()[0].split(",")
    assert not any(ipaddress.ip_address(address).is_loopback for address in published_hosts), (
        published_hosts
    )
    assert published_hosts == [a.address]  # host A's only address besides loopback
    # Gloo, too, listens where the other host reaches it, not on 127.0.1.1.
    assert [results[0]["gloo_interface"], results[1]["gloo_interface"]] == [
        a.interface,
        b.interface,
    ]


def test_a_rank_killed_mid_epoch_on_host_b_is_restarted_and_resumes_exactly(
    hosts, uninterrupted, tmp_path
):
    reference, _ = uninterrupted
    directories = [tmp_path / host.name for host in hosts]
    for directory in directories:
        directory.mkdir()
    outputs, seconds = _torchrun_on_both(
        hosts,
        directories,
        29402,
        "hapi-two-hosts-kill",
        KILL_AT_STEP,
        options=("--max-restarts=1",),
        KILL_RANK="1",
        KILL_MARKER=str(tmp_path / "killed"),
    )
    print(f"\ntwo hosts, kill + restart + resume: {seconds:.1f} s wall")
    assert (tmp_path / "killed").exists()  # rank 1 did die mid-epoch
    assert "BackupAndRestore: resuming from" in "".join(outputs)
    resumed = _results(directories)
    for rank in (0, 1):
        difference = _max_difference(resumed[rank]["weights"], reference[rank]["weights"])
        print(f"two hosts, rank {rank} resumed vs uninterrupted: max |dw| = {difference:.2e}")
        assert difference < 1e-6
        assert resumed[rank]["history"] == reference[rank]["history"]
        assert resumed[rank]["step"] == reference[rank]["step"]
    assert (
        resumed[0]["published"].split()[0] == reference[0]["published"].split()[0]
    )  # published again, alike
