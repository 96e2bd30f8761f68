"""parity.core.hardware: what the machine is, what it cannot run (probed, not guessed), thread control,
and that the environment variables CI uses to narrow a CPU to AVX2 really take effect."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

from parity.core import hardware  # noqa: E402
from parity.perf import measure  # noqa: E402

pytestmark = pytest.mark.torch

X86 = platform.machine() in ("x86_64", "AMD64")


def _torch_bf16_lstm_fails() -> bool:
    """The ground truth, straight from torch: does a bf16-autocast LSTM run on this CPU?"""
    module = torch.nn.LSTM(4, 4, batch_first=True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            module(torch.zeros(1, 3, 4))
    except RuntimeError:
        return True
    return False


def test_hardware_info_describes_both_frameworks_as_json():
    import jax

    info = hardware.hardware_info()
    json.dumps(info)  # goes into results.json as is
    assert info["torch"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["torch"]["intra_op_threads"] == torch.get_num_threads()
    assert info["jax"]["version"] == jax.__version__
    assert info["jax"]["device_count"] == len(jax.devices())
    assert info["cpu"]["available_cpus"] >= 1
    assert set(info["cpu"]["flags"]) <= set(hardware.CPU_FLAGS_OF_INTEREST)
    if X86 and hardware.cpu_flags():
        assert ("avx2" in info["cpu"]["flags"]) == ("avx2" in hardware.cpu_flags())
    summary = hardware.hardware_summary(info)
    assert info["torch"]["cpu_capability"] in summary and "CPU" in summary


@pytest.mark.integration
@pytest.mark.slow
def test_hardware_info_never_imports_torch():
    code = (
        "import sys, jax; from parity.core.hardware import hardware_info; info = hardware_info(); "
        "assert 'torch' not in sys.modules, 'imported torch'; assert info['torch'] is None; "
        "assert info['jax']['backend'] == 'cpu'; print('ok')"
    )
    out = _run(code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_unsupported_reason_matches_torch_itself():
    """The answer is whatever torch does here: an AVX2 CPU fails, an AVX-512 one runs."""
    reason = hardware.unsupported_reason("torch", "bf16-mixed", "lstm", "cpu")
    assert (reason is not None) == _torch_bf16_lstm_fails()
    if reason is not None:
        assert "LSTM" in reason and torch.backends.cpu.get_cpu_capability() in reason
    # the same verdict for a user's module holding an LSTM, and for the Policy form
    user_model = torch.nn.Sequential(torch.nn.LSTM(3, 3))
    assert hardware.unsupported_reason("torch", "p=f32,c=bf16,o=f32", user_model, "cpu") == reason


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed", "bf16-true"])
def test_cells_every_cpu_runs_are_supported(precision):
    # the built-in lstm runs its LSTM in float16 itself; bf16-true has a native kernel
    assert hardware.unsupported_reason("torch", precision, "lstm", "cpu") is None
    for model in ("mlp", "cnn", "transformer"):
        assert hardware.unsupported_reason("torch", "bf16-mixed", model, "cpu") is None
    assert hardware.unsupported_reason("jax", precision, "lstm", "cpu") is None


def test_user_float16_lstm_is_probed_too():
    """A user's module with an nn.LSTM under fp16 autocast: oneDNN has no fp16 LSTM anywhere."""
    module = torch.nn.Sequential(torch.nn.LSTM(3, 3))
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            module[0](torch.zeros(1, 2, 3))
        fails = False
    except RuntimeError:
        fails = True
    reason = hardware.unsupported_reason("torch", "fp16-mixed", module, "cpu")
    assert (reason is not None) == fails


def test_gpu_reason_follows_the_frameworks():
    import jax

    torch_reason = hardware.unsupported_reason("torch", "fp32", "mlp", "gpu")
    assert (torch_reason is None) == torch.cuda.is_available()
    jax_reason = hardware.unsupported_reason("jax", "fp32", "mlp", "gpu")
    try:
        jax.devices("gpu")
        has_gpu = True
    except RuntimeError:
        has_gpu = False
    assert (jax_reason is None) == has_gpu


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="framework must be 'torch' or 'jax'; got 'tf'"):
        hardware.unsupported_reason("tf", "fp32", "mlp", "cpu")
    with pytest.raises(ValueError, match="device must be"):
        hardware.unsupported_reason("torch", "fp32", "mlp", "tpu")
    with pytest.raises(ValueError, match="`threads` must be an integer from 1"):
        measure.set_threads(0)
    with pytest.raises(ValueError, match="`threads`"):
        measure.set_threads(10_000)


def test_unsupported_here_carries_the_reason():
    error = hardware.UnsupportedHere("no kernel")
    assert error.reason == "no kernel" and "unsupported here: no kernel" in str(error)
    assert isinstance(error, RuntimeError)


def test_skip_helpers_skip_exactly_when_unsupported():
    reason = hardware.unsupported_reason("torch", "bf16-mixed", "lstm", "cpu")
    mark = hardware.requires_torch_cpu("bf16-mixed", "lstm")
    assert mark.args[0] == (reason is not None)
    if reason is None:
        hardware.skip_if_unsupported("torch", "bf16-mixed", "lstm")  # no skip
    else:
        with pytest.raises(pytest.skip.Exception, match="unsupported here"):
            hardware.skip_if_unsupported("torch", "bf16-mixed", "lstm")


def test_torch_bf16_emulation_follows_capability():
    assert hardware.torch_bf16_is_emulated({"cpu_capability": "AVX2"}) is True
    assert hardware.torch_bf16_is_emulated({"cpu_capability": "DEFAULT"}) is True
    if not {"avx512_bf16", "amx_bf16"} & hardware.cpu_flags():
        assert hardware.torch_bf16_is_emulated() is True


# Appended to each child's code: its last garbage collection at exit would walk every object
# torch and JAX made (about half a CPU second); frozen, it is skipped (the test's checks are
# printed before it).
_FREEZE_AT_EXIT = "\nimport gc; gc.freeze()"


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code + _FREEZE_AT_EXIT],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


@pytest.mark.integration
@pytest.mark.slow
def test_aten_cpu_capability_takes_effect():
    """CI's AVX2 pass relies on it: torch must report (and use) the capability it is given.
    "default" is below every CPU, so the variable's effect is visible on any machine."""
    capability = "avx2" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "default"
    code = (
        "import torch; from parity.core.hardware import hardware_info, torch_bf16_is_emulated; "
        "info = hardware_info(); print(info['torch']['cpu_capability'], torch_bf16_is_emulated())"
    )
    out = _run(code, ATEN_CPU_CAPABILITY=capability)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [capability.upper(), "True"]


def test_torch_compile_under_a_capability_setting_warns_without_its_own_kernel_cache(
    monkeypatch, tmp_path
):
    """torch.compile on CPU with ``ATEN_CPU_CAPABILITY`` set and inductor's default kernel cache
    (unset, or the folder torch writes into the variable once it has used it) warns, naming
    TORCHINDUCTOR_CACHE_DIR: that cache does not key kernels on the setting. With a cache of
    its own, without the setting, or eager, the trainer is silent. The run records the
    variable."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from parity.core.config import RunConfig
    from parity.models import get_model_pair
    from parity.training.train_torch import build_torch_step

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)  # no compile needed
    pair = get_model_pair("mlp", seed=0, image_shape=(4, 4, 3), hidden=8)
    compiled = RunConfig(model="mlp", precision="fp32", steps=1, torch_compile=True)
    eager = RunConfig(model="mlp", precision="fp32", steps=1)
    own = str(tmp_path / "inductor-avx2")

    def environment(capability, cache):
        for name, value in (
            ("ATEN_CPU_CAPABILITY", capability),
            ("TORCHINDUCTOR_CACHE_DIR", cache),
        ):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)

    for cache in (None, default_cache_dir()):
        environment("avx2", cache)
        with pytest.warns(RuntimeWarning, match="TORCHINDUCTOR_CACHE_DIR"):
            build_torch_step(compiled, pair)
    for config, capability, cache in (
        (compiled, "avx2", own),
        (compiled, None, None),
        (eager, "avx2", None),
    ):
        environment(capability, cache)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            build_torch_step(config, pair)
    environment("avx2", own)
    assert hardware.hardware_info()["env"]["TORCHINDUCTOR_CACHE_DIR"] == own


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="ONEDNN_MAX_CPU_ISA names x86 ISAs")
def test_onednn_max_cpu_isa_takes_effect_and_removes_bf16_lstm():
    """oneDNN's verbose output names the ISA it dispatches for. Capped below this CPU (AVX2 on an
    AVX-512 CPU, as CI's second pass does; SSE4.1 on an AVX2 one) the cap shows, and the bf16
    LSTM kernel is gone, so the harness and the tests see "unsupported here"."""
    wider = "avx512f" in hardware.cpu_flags()
    cap, shown = ("AVX2", "AVX2") if wider else ("SSE41", "SSE4.1")
    code = (
        "import torch; m = torch.nn.LSTM(4, 4); m(torch.zeros(2, 1, 4)); "
        "from parity.core.hardware import unsupported_reason; "
        "print('REASON', unsupported_reason('torch', 'bf16-mixed', 'lstm', 'cpu') is not None)"
    )
    out = _run(code, ONEDNN_MAX_CPU_ISA=cap, ONEDNN_VERBOSE="1")
    assert out.returncode == 0, out.stderr[-2000:]
    isa = [line for line in out.stdout.splitlines() if ",isa:" in line]
    assert isa and shown in isa[0] and "512" not in isa[0], out.stdout[-2000:]
    assert "REASON True" in out.stdout


def test_set_threads_gives_both_frameworks_the_same_count():
    before = torch.get_num_threads()
    try:
        settings = measure.set_threads()
        assert settings["torch_intra_op_threads"] == torch.get_num_threads()
        assert settings["torch_intra_op_threads"] == settings["xla_cpu_intra_op_threads"]
        assert measure.thread_warnings(settings) == []
        assert measure.thread_warnings({"torch_intra_op_threads": 1, "xla_cpu_intra_op_threads": 2})
    finally:
        torch.set_num_threads(before)


@pytest.mark.integration
@pytest.mark.slow
def test_one_thread_reaches_xla_in_a_fresh_process():
    code = (
        "from parity.perf.measure import set_threads; s = set_threads(1); import jax, jax.numpy as jnp; "
        "jnp.ones(3).block_until_ready(); import os; "
        "print(s['torch_intra_op_threads'], s['xla_cpu_intra_op_threads'], "
        "'multi_thread_eigen=false' in os.environ['XLA_FLAGS'])"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "1", "True"]


def test_time_interleaved_rotates_and_keeps_repeats():
    order = []
    times = measure.time_interleaved(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3, warmup=1
    )
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [len(v) for v in times.values()] == [3, 3]
    with pytest.raises(ValueError, match="`repeats`"):
        measure.time_interleaved({"a": lambda: None}, repeats=0)
