"""The ``ccl`` backend of helpers.ranks.oneccl in real processes, checked against gloo.

Every collective runs on 2 and 3 processes (a TCPStore on 127.0.0.1, oneCCL over shared memory as
:func:`oneccl.environment` sets it for one node) and is compared with gloo on the same tensors in
the same processes: integers exactly, floats to rounding. A rank that never joins and a rank
killed mid-run must end in a clear error within the process group's timeout, never a hang.
Skipped, with the reason, where the extension cannot be built (``make setup`` builds it).

This file is also the ranks' program: ``python test_oneccl.py <json spec>``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 5.0  # seconds: the process group's timeout in the failure tests
SLACK = 10.0  # seconds allowed beyond it (a loaded 2-core machine)
HARD_LIMIT = 120.0  # seconds: any run of ranks is killed after this


# --- the ranks' program --------------------------------------------------------------------------


def _checks(dist, torch, rank: int, world: int, ccl, gloo) -> tuple[int, list[str]]:
    """Run each collective on ``ccl`` and on ``gloo``; the number of checks and the mismatches."""
    R = dist.ReduceOp
    failures: list[str] = []
    count = 0

    def data(dtype, n, salt=0):
        g = torch.Generator().manual_seed(1000 * rank + salt)
        if dtype.is_floating_point:
            return torch.randn(n, generator=g).to(dtype)
        return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)

    def same(name, a, b):
        nonlocal count
        count += 1
        if a.dtype in (torch.int32, torch.int64):
            ok = torch.equal(a, b)
        else:
            tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[a.dtype]
            ok = a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
        if not ok:
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
            failures.append(f"{name}: ccl and gloo differ (max abs difference {diff})")

    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.int64]
    n = 1003  # not a multiple of the world size, nor of a vector width
    for dtype in dtypes:
        floating = dtype.is_floating_point
        ops = [R.SUM, R.MIN, R.MAX] + ([R.AVG] if floating else [])
        for op in ops:
            a = data(dtype, n)
            b = a.clone()
            dist.all_reduce(a, op=op, group=ccl)
            dist.all_reduce(b, op=op, group=gloo)
            same(f"all_reduce {dtype} {op}", a, b)
        a = data(dtype, n, salt=1)
        b = a.clone()
        dist.broadcast(a, src=world - 1, group=ccl)
        dist.broadcast(b, src=world - 1, group=gloo)
        same(f"broadcast {dtype}", a, b)

        x = data(dtype, n, salt=2)
        outs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs, x, group=ccl)
        ref = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(ref, x, group=gloo)
        same(f"all_gather {dtype}", torch.stack(outs), torch.stack(ref))

        flat = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(flat, x, group=ccl)
        same(f"all_gather_into_tensor {dtype}", flat, torch.cat(ref))

        # gloo has no reduce_scatter: its reference is all_reduce, then this rank's part.
        for op in [R.SUM, R.MAX] + ([R.AVG] if floating else []):
            big = data(dtype, world * n, salt=3)
            whole = big.clone()
            dist.all_reduce(whole, op=op, group=gloo)
            part = whole[rank * n : (rank + 1) * n]
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, big, op=op, group=ccl)
            same(f"reduce_scatter_tensor {dtype} {op}", out, part)
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(out, list(big.chunk(world)), op=op, group=ccl)
            same(f"reduce_scatter {dtype} {op}", out, part)

        a = data(dtype, n, salt=4)
        b = a.clone()
        dist.reduce(a, dst=0, group=ccl)
        dist.reduce(b, dst=0, group=gloo)
        if rank == 0:
            same(f"reduce {dtype}", a, b)
    dist.barrier(group=ccl)
    count += 1

    # Clear errors, raised before anything is sent (so the ranks stay in step).
    for name, bad in [("non-contiguous", torch.ones(4, 6).t()), ("bool", torch.ones(3, dtype=torch.bool))]:
        count += 1
        try:
            dist.all_reduce(bad, group=ccl)
            failures.append(f"all_reduce of a {name} tensor did not raise")
        except Exception as err:  # noqa: BLE001
            if "ccl backend" not in str(err):
                failures.append(f"all_reduce of a {name} tensor: unclear error {err}")
    return count, failures


def _rank_main(spec: dict) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from helpers.ranks import oneccl

    torch.set_num_threads(1)
    rank, world = spec["rank"], spec["world"]
    timeout = datetime.timedelta(seconds=spec["timeout"])
    result: dict = {"rank": rank, "provider": oneccl.load()}
    store = dist.TCPStore(
        "127.0.0.1", spec["port"], world, rank == 0, timeout=timeout, wait_for_workers=False
    )
    start = time.monotonic()
    try:
        dist.init_process_group("ccl", store=store, rank=rank, world_size=world, timeout=timeout)
        if spec["mode"] == "compare":
            gloo = dist.new_group(backend="gloo")
            result["checks"], result["failures"] = _checks(dist, torch, rank, world, None, gloo)
            dist.destroy_process_group()
            # A second group on the same store (same name) starts afresh.
            dist.init_process_group("ccl", store=store, rank=rank, world_size=world, timeout=timeout)
            x = torch.full((5,), rank + 1, dtype=torch.int64)
            dist.all_reduce(x)
            if x.tolist() != [world * (world + 1) // 2] * 5:
                result["failures"].append(f"all_reduce after re-initialising gave {x.tolist()}")
            dist.destroy_process_group()
        elif spec["mode"] == "killed":
            x = torch.ones(768)
            for i in range(1_000_000):
                if rank == world - 1 and i == 50:
                    os.kill(os.getpid(), 9)  # this rank dies in the middle of the run
                start = time.monotonic()
                dist.all_reduce(x)
    except Exception as err:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(err).__name__}: {err}"
        result["seconds_to_error"] = time.monotonic() - start
        print("RESULT " + json.dumps(result), flush=True)
        return 3
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# --- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ccl_built():
    from helpers.ranks import oneccl

    try:
        oneccl.build()
    except oneccl.CclUnavailable as err:
        pytest.skip(f"the ccl backend cannot be built here: {err}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(ranks: list[int], world: int, mode: str, timeout: float) -> dict[int, dict]:
    """Start the given ranks, wait at most HARD_LIMIT; each rank's RESULT, return code and output."""
    from helpers.ranks import oneccl

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update({name: value for name, value, _ in oneccl.environment(world, 1, os.cpu_count() or 1, 1)})
    port = _free_port()
    procs = {}
    try:
        for r in ranks:
            spec = {"rank": r, "world": world, "port": port, "mode": mode, "timeout": timeout}
            procs[r] = subprocess.Popen(
                [sys.executable, __file__, json.dumps(spec)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        deadline = time.monotonic() + HARD_LIMIT
        out = {}
        for r, p in procs.items():
            try:
                text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} of {world} ({mode}) still running after {HARD_LIMIT:.0f} s: a hang")
            lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {}
            ccl_lines = [ln for ln in text.splitlines() if "|CCL_" in ln]  # oneCCL's own messages
            out[r] = {**res, "returncode": p.returncode, "output": text[-3000:], "ccl_lines": ccl_lines}
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        oneccl.remove_regions(
            p.pid for p in procs.values()
        )  # a killed rank's shared memory, as helpers.launch does


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_gloo(ccl_built, world):
    results = _run_ranks(list(range(world)), world, "compare", timeout=60.0)
    for r, res in results.items():
        assert res["returncode"] == 0, f"rank {r} failed:\n{res['output']}"
        assert res["provider"] == "helpers.ranks.oneccl"
        assert res["checks"] > 60
        assert res["failures"] == [], f"rank {r}: {res['failures']}"
        assert res["ccl_lines"] == []  # issue 48: not even oneCCL's notice of CCL_LOG_LEVEL itself


def test_a_rank_that_never_joins_is_an_error_within_the_timeout(ccl_built):
    start = time.monotonic()
    res = _run_ranks([0], 2, "compare", timeout=TIMEOUT)[0]
    assert res["returncode"] == 3, res["output"]
    assert "only 1 of 2 ranks joined" in res["error"], res["error"]
    assert res["seconds_to_error"] < TIMEOUT + SLACK
    assert time.monotonic() - start < TIMEOUT + 60  # and the process exits (start-up included)


def test_a_killed_rank_makes_the_survivor_fail_within_the_timeout(ccl_built):
    results = _run_ranks([0, 1], 2, "killed", timeout=TIMEOUT)
    assert results[1]["returncode"] == -9, results[1]["output"]
    survivor = results[0]
    assert survivor["returncode"] == 3, survivor["output"]
    assert "did not complete within 5 s" in survivor["error"], survivor["error"]
    assert survivor["seconds_to_error"] < TIMEOUT + SLACK


def test_environment_chooses_the_transport():
    from helpers.ranks import oneccl

    one = {n: v for n, v, _ in oneccl.environment(2, 1, 2, 1)}
    assert one["CCL_ATL_TRANSPORT"] == "ofi"
    assert (one["FI_PROVIDER"], one["CCL_ATL_SHM"]) == ("shm", "1")
    assert one["CCL_YIELD"] == "sched_yield"  # 2 ranks x (1 thread + 1 worker) > 2 cores
    assert one["CCL_LOG_LEVEL"] == "error"  # not a CCL_WARN line per variable on every rank
    many = {n: v for n, v, _ in oneccl.environment(1, 2, 8, 2, interface="eth1")}
    assert many["FI_PROVIDER"] == "tcp" and many["FI_TCP_IFACE"] == many["CCL_KVS_IFACE"] == "eth1"
    assert "CCL_ATL_SHM" not in many and "CCL_YIELD" not in many
    assert all(reason and "\n" not in reason for _, _, reason in oneccl.environment(4, 3, 2, 1, "eth0"))


def test_only_oneccls_notice_of_its_own_log_level_is_held_back(capfd, monkeypatch):
    from helpers.ranks import oneccl

    notice = (
        b"2026:11:27-20:48:06:10167 |CCL_WARN| value of CCL_LOG_LEVEL changed to be error (default:warn)\n"
    )
    other = b"2026:11:27-20:48:06:10167 |CCL_ERROR| something real\n"
    monkeypatch.setenv("CCL_LOG_LEVEL", "error")
    with oneccl._without_log_level_notice():
        os.write(1, notice + other + b"a line of the program\n")
    assert capfd.readouterr().out == (other + b"a line of the program\n").decode()
    monkeypatch.setenv("CCL_LOG_LEVEL", "warn")  # someone asked for oneCCL's warnings: all of them
    with oneccl._without_log_level_notice():
        os.write(1, notice.replace(b"error (", b"warn ("))
    assert capfd.readouterr().out == notice.replace(b"error (", b"warn (").decode()


def test_build_command_prints_one_line(ccl_built):
    done = subprocess.run(
        [sys.executable, "-m", "helpers.ranks.oneccl", "build"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("ccl backend ready: ")


if __name__ == "__main__":
    sys.exit(_rank_main(json.loads(sys.argv[1])))
