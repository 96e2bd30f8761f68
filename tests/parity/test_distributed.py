"""parity.distributed: owned and bounded workers, plan validation, and short multi-device runs.

The multi-device runs start torch ranks (gloo on 127.0.0.1) and JAX worker processes (their own
host device count); every test checks that no worker outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch]

from parity.core.config import RunConfig  # noqa: E402
from parity.distributed import (  # noqa: E402
    DistributedPlan,
    WorkerError,
    WorkerGroup,
    free_port,
    run_distributed,
)
from parity.distributed.hlo import reduction_collectives, reduction_dtypes  # noqa: E402
from parity.distributed.procs import forking, live_worker_pids  # noqa: E402


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is not running: read its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.integration
def test_worker_group_ends_every_worker_when_one_fails():
    with WorkerGroup(timeout_s=30) as group:
        group.start("sleeper", SLEEPER)
        group.start("failer", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
        with pytest.raises(WorkerError, match=r"failer.*code 3(.|\n)*boom"):
            group.wait()
        pids = group.pids
    assert not any(_alive(p) for p in pids)
    assert live_worker_pids() == []


@pytest.mark.integration
def test_worker_group_timeout_ends_workers():
    start = time.monotonic()
    with WorkerGroup(timeout_s=1.0) as group:
        group.start("sleeper", SLEEPER)
        with pytest.raises(WorkerError, match="timeout"):
            group.wait()
        pids = group.pids
    assert time.monotonic() - start < 15
    assert not any(_alive(p) for p in pids)


@pytest.mark.integration
def test_worker_group_success_and_validation():
    with WorkerGroup(timeout_s=30) as group:
        group.start("echo", [sys.executable, "-c", "print('hi')"])
        results = group.wait()
    assert results[0].returncode == 0 and results[0].output.strip() == "hi"
    with pytest.raises(ValueError, match="timeout_s"):
        WorkerGroup(timeout_s=0)


# `timeit.main(args)`: a module with a main a zygote can fork (stdlib, imports in milliseconds)
FORKED_SLEEPER = ["-n", "1", "-r", "1", "import time; time.sleep(60)"]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(")")[-1].split()[1])


@pytest.mark.integration
def test_forked_workers_are_owned_as_started_ones(tmp_path):
    """Workers forked by a zygote (`forking`, `WorkerGroup.start_forked`): each a child of the
    zygote in its own session, its output in its log, its exit status relayed; a failure ends
    the others; the zygote ends with its block. A zygote running threads refuses to fork, and
    one that does not answer in time is ended: the worker starts as a process of its own."""
    env = dict(os.environ)
    with forking(["timeit"], env, tmp_path / "zygote.log") as zygote:
        with WorkerGroup(timeout_s=60, log_dir=tmp_path) as group:
            group.start_forked("ok", zygote, "timeit", ["-n", "1", "-r", "1", "pass"])
            (ok,) = group.wait()
        assert ok.returncode == 0 and "1 loop, best of 1" in ok.output
        with WorkerGroup(timeout_s=60, log_dir=tmp_path) as group:
            sleeper = group.start_forked("sleeper", zygote, "timeit", FORKED_SLEEPER)
            assert _parent(sleeper) == zygote.pid and os.getsid(sleeper) == sleeper
            assert sorted(live_worker_pids()) == sorted([zygote.pid, sleeper])
            boom = ["-n", "1", "-r", "1", "raise ValueError('boom')"]
            group.start_forked("failer", zygote, "timeit", boom)
            with pytest.raises(WorkerError, match=r"failer.*code 1(.|\n)*ValueError: boom"):
                group.wait()
        assert not _alive(sleeper)
    assert not _alive(zygote.pid) and live_worker_pids() == []
    # A thread at import: the zygote refuses, and the worker starts as `python -m spin ARGS`.
    (tmp_path / "spin.py").write_text(
        "import sys, threading, time, timeit\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "main = timeit.main\n"
        "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n"
    )
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    with forking(["spin"], env, tmp_path / "spin-zygote.log") as zygote:
        with WorkerGroup(timeout_s=60, log_dir=tmp_path) as group:
            pid = group.start_forked("spun", zygote, "spin", FORKED_SLEEPER, env=env)
            assert _parent(pid) == os.getpid() and os.getsid(pid) == pid
            group.terminate()
        assert not _alive(pid)
    # No answer in time (still importing): the zygote is ended, so that it never runs the
    # command for nobody, and later workers start as processes.
    (tmp_path / "slow.py").write_text("import time, timeit\ntime.sleep(60)\nmain = timeit.main\n")
    with forking(["slow"], env, tmp_path / "slow-zygote.log") as zygote:
        assert zygote.fork("slow", ["pass"], tmp_path / "late.log", timeout_s=0.5) is None
        assert not _alive(zygote.pid)
        with WorkerGroup(timeout_s=60, log_dir=tmp_path) as group:
            pid = group.start_forked("after", zygote, "timeit", ["-n", "1", "-r", "1", "pass"])
            assert _parent(pid) == os.getpid()
            (after,) = group.wait()
        assert after.returncode == 0 and "1 loop, best of 1" in after.output


@pytest.mark.integration
def test_ctrl_c_ends_workers(tmp_path):
    # A harness process with a worker and a forked one; SIGINT to the harness must end both,
    # and the zygote.
    pid_file = tmp_path / "pid"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from parity.distributed.procs import WorkerGroup, forking
        log = {str(tmp_path / "zygote.log")!r}
        with forking(["timeit"], dict(os.environ), log) as z, WorkerGroup(timeout_s=60) as g:
            pid = g.start("sleeper", {SLEEPER!r})
            forked = g.start_forked("forked", z, "timeit", {FORKED_SLEEPER!r})
            open({str(pid_file)!r}, "w").write(f"{{pid}} {{forked}} {{z.pid}}")
            g.wait()
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    harness = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "worker never started"
            time.sleep(0.05)
        workers = [int(p) for p in pid_file.read_text().split()]
        assert len(workers) == 3 and all(_alive(p) for p in workers)
        harness.send_signal(signal.SIGINT)
        harness.wait(timeout=20)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in workers)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()


def test_free_port_binds_loopback():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_plan_validation():
    with pytest.raises(ValueError, match="Did you mean 'fsdp'"):
        DistributedPlan(strategy="fsd")
    with pytest.raises(ValueError, match="Did you mean 'shard_map'"):
        DistributedPlan(jax_modes=("shardmap",))
    with pytest.raises(ValueError, match="devices"):
        DistributedPlan(devices=0)
    with pytest.raises(ValueError, match="torch ranks"):
        DistributedPlan(devices=2, inject_overflow=(1, 2))
    config = RunConfig(model="mlp", batch_size=6, steps=2)
    with pytest.raises(ValueError, match="divisible"):
        run_distributed(config, DistributedPlan(devices=4))
    with pytest.raises(ValueError, match="fp16-mixed"):
        run_distributed(
            RunConfig(model="mlp", batch_size=8), DistributedPlan(inject_overflow=(1, 0))
        )
    with pytest.raises(ValueError, match="BatchNorm"):
        run_distributed(RunConfig(model="cnn_bn", batch_size=8, steps=1), DistributedPlan())


def test_hlo_parser(tmp_path):
    (tmp_path / "module_1.jit_train_step.after_spmd-partitioning.txt").write_text(
        "  %all-reduce.1 = bf16[8,16]{1,0} all-reduce(%dot.1), to_apply=%add, "
        'metadata={op_name="transpose(jvp())/dot_general"}\n'
        "  %all-reduce.2 = (f32[], f32[8]{0}) all-reduce(%a, %b), to_apply=%add\n"
        "  %rs = f32[4]{0} reduce-scatter(%c), dimensions={0}\n"
        "  %ag = bf16[8]{0} all-gather(%d), dimensions={0}\n"
    )
    colls = reduction_collectives(tmp_path, "train_step")
    assert [c["op"] for c in colls] == ["all-reduce", "all-reduce", "reduce-scatter"]
    assert colls[0]["op_name"] == "transpose(jvp())/dot_general"
    assert reduction_dtypes(colls) == ["bfloat16", "float32"]


def _assert_no_strays(result):
    pids = [r["pid"] for results in result.ranks.values() for r in results]
    assert pids and not any(_alive(p) for p in pids)
    assert live_worker_pids() == []


def _failed(result):
    return [v for v in result.verdicts if v.passed is False]


@pytest.mark.integration
@pytest.mark.slow
def test_fp16_injected_overflow_skips_on_every_rank_both_sides(tmp_path):
    config = RunConfig(
        model="mlp",
        precision="fp16-mixed",
        steps=4,
        batch_size=8,
        lr_warmup_steps=2,
        eval=False,
        model_overrides={"image_shape": (4, 4, 3), "hidden": 8},
    )
    plan = DistributedPlan(
        devices=4, torch_ranks=2, strategy="ddp", jax_modes=("jit",), inject_overflow=(2, 1)
    )
    # The step-0 gate is the one-device cell's (`run_cell`; a distributed run's gate is
    # test_parity_distributed's): what is checked here is the workers' training.
    result = run_distributed(config, plan, tmp_path, step0_checks=False, plots=False)
    assert result.status == "PASS", _failed(result)
    assert not any(v.mode == "step 0" for v in result.verdicts)
    injected = [v for v in result.verdicts if v.check.startswith("injected overflow")]
    assert {v.compared for v in injected} == {"torch", "jax:jit"}
    assert all(v.passed for v in injected)
    for results in result.ranks.values():
        for r in results:
            assert [s["skipped"] for s in r["steps"]] == [False, False, True, False]
            # The single-device trainers' signals: the overflow's gradient norm is not finite.
            assert [s["grad_norm"] is None for s in r["steps"]] == [False, False, True, False]
            assert all(len(s["max_scaled_grad"]) == 6 for s in r["steps"])
    _assert_no_strays(result)


def test_pair_factory_import_path():
    from parity.distributed.pairs import load_pair_factory
    from parity.models import get_model_pair

    assert load_pair_factory("parity.models:get_model_pair") is get_model_pair
    with pytest.raises(ValueError, match="package.module:function"):
        load_pair_factory("parity.models.get_model_pair")
    with pytest.raises(ValueError, match="Did you mean 'get_model_pair'"):
        load_pair_factory("parity.models:get_model_pairs")


def test_workers_get_the_callers_xla_flags_but_those_they_set_themselves(monkeypatch):
    from parity.distributed.run import _worker_env

    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    monkeypatch.setenv("XLA_FLAGS", flags + " --xla_dump_to=/tmp/elsewhere")
    assert _worker_env()["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert "XLA_FLAGS" not in _worker_env()  # a multi-process worker sees its own device
