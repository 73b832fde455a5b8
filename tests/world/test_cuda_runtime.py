"""The ``cuda`` section of a job (--gpu, --alloc-conf, the runtime's figures): what it resolves to, and one-line errors
naming the field and the bad value."""

from __future__ import annotations

import pytest

from hyperdryrun.cli import main
from hyperdryrun.config import ConfigError, build_config
from hyperdryrun.world.runtime import CudaRuntime, cublas_config_bytes


def run_cli(argv, capsys, tmp_path):
    try:
        rc = main(["run", "--model", "llama-tiny", "--seq-len", "32", "--output-dir", str(tmp_path), *argv])
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--gpu", "v100"], "cuda.gpu (--gpu): gpu='v100': choose one of a100-40gb, a100-80gb, h100-80gb"),
        (["--gpu", "mi300x"], "cuda.gpu (--gpu): gpu='mi300x' is not a CUDA GPU the dry run models"),
        (
            ["--alloc-conf", "expandable_segments:yes"],
            "cuda.alloc_conf (--alloc-conf): expandable_segments: expected True or False (got 'yes')",
        ),
        (
            ["--alloc-conf", "max_split_mb:64"],
            "cuda.alloc_conf (--alloc-conf): unrecognized key 'max_split_mb'",
        ),
    ],
    ids=["unknown-gpu", "rocm-gpu", "alloc-conf-value", "alloc-conf-key"],
)
def test_bad_flags_are_one_line_errors_naming_the_field_and_value(argv, expected, capsys, tmp_path):
    rc, err = run_cli(argv, capsys, tmp_path)
    assert rc == 2
    assert err.count("\n") == 1 and expected in err, err


def test_a_bad_pytorch_cuda_alloc_conf_fails_the_run_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:2")
    rc, err = run_cli(["--quiet"], capsys, tmp_path)
    assert rc == 2 and err.count("\n") == 1
    assert "$PYTORCH_CUDA_ALLOC_CONF: garbage_collection_threshold: must be in (0.0, 1.0) (got 2.0)" in err


@pytest.mark.parametrize(
    "section, expected",
    [
        ({"cublas_workspace_config": "4096"}, "cuda.cublas_workspace_config: expected :SIZE_KiB:COUNT pairs"),
        ({"nccl_channels": 0}, "cuda.nccl_channels: Input should be greater than 0 (got 0)"),
        ({"context_mib": -1}, "cuda.context_mib: Input should be greater than or equal to 0 (got -1)"),
        ({"gpu_name": "h200"}, "cuda.gpu_name: Extra inputs are not permitted"),
    ],
)
def test_bad_cuda_fields_in_a_job_file_are_one_line_errors(section, expected):
    with pytest.raises(ConfigError) as info:
        build_config({"model": {"name": "llama-tiny"}, "cuda": section})
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_cublas_workspace_config_sums_size_times_count_as_torch_does():
    # torch 2.13 parseChosenWorkspaceSize: each ":SIZE:COUNT" is SIZE KiB times COUNT
    assert cublas_config_bytes(":4096:2:16:8") == 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680
    assert cublas_config_bytes(":4096:8") == 32 * 2**20
    assert cublas_config_bytes("nonsense") is None


def test_settings_say_where_every_figure_came_from():
    s = CudaRuntime(gpu="a100-40gb").settings(environ={})
    # deviceQuery's totalGlobalMem on an A100-SXM4-40GB (bottlerocket-os/bottlerocket#3873)
    assert s["capacity_bytes"] == 42_298_834_944 and s["gpu"]["named"] is True
    assert s["allocator"] == {"settings": "", "source": "torch's defaults"}
    assert s["cublas_workspace"]["bytes_per_handle"] == 8_519_680
    # the H200 after a training step: nvidia-smi minus max_memory_reserved (docs/gpu/h200_measured.json, p1)
    assert (
        s["nccl"]["buffsize"] == 4 * 2**20 and s["cuda_context"]["bytes"] == 80_885_055_488 - 80_004_251_648
    )
    assert s["kernels"] == "sm80 (a100-40gb), cuDNN 9.20, CUDA 13.0"
    unnamed = CudaRuntime().settings(environ={"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert unnamed["capacity_bytes"] is None and unnamed["gpu"]["name"] == "h100-80gb"
    assert unnamed["allocator"] == {"settings": "expandable_segments:True", "source": "$PYTORCH_ALLOC_CONF"}
    # a CUBLAS_WORKSPACE_CONFIG torch cannot parse: torch warns and takes the default, and so does the dry run
    odd = CudaRuntime().settings(environ={"CUBLAS_WORKSPACE_CONFIG": "4096"})
    assert odd["cublas_workspace"]["bytes_per_handle"] == 32 * 2**20
    assert "does not parse" in odd["cublas_workspace"]["source"]
