"""torchtitan 0.3.0's float8 and MXFP8 configs as written: their converters' GPU checks answer as the target preset
(float8 needs sm89+, MXFP8 sm100), so the jobs run on the GPUs that run them and are refused in one line on the
others, as on the card. One layer at 256 tokens keeps each run to seconds."""

from __future__ import annotations

import json

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install 'hyperdryrun[torchtitan]')"
)
pytest.importorskip("torchao", reason="torchao is not installed (pip install 'hyperdryrun[float8]')")

from hyperdryrun.integrations.torchtitan import TorchtitanError, simulate_torchtitan  # noqa: E402
from tests.conftest import cli  # noqa: E402

SMALL = ["--training.seq_len", "256", "--parallelism.data_parallel_shard_degree", "2"]
MXFP8 = ["--module", "llama3", "--config", "llama3_8b_mxfp8", *SMALL]
FLOAT8 = ["--module", "llama3", "--config", "llama3_debugmodel_float8", *SMALL]


def _run(argv: list[str], gpu: str):
    from hyperdryrun.world.runtime import CudaRuntime

    cuda = CudaRuntime(gpu=gpu)
    return simulate_torchtitan(argv, world_size=2, rank=0, n_layers=1, capture_stacks=False, cuda=cuda)


def test_llama3_8b_mxfp8_runs_on_a_b200_with_mxfp8_linears():
    trace = _run(MXFP8, "b200")
    # one layer: wqkv, wo, w1, w2, w3, and the head (the MXFP8 converter converts every Linear)
    assert trace.metadata["torchtitan"]["quantization"] == {"MXFP8Linear": 6}
    assert trace.metadata["cuda"]["gpu"]["name"] == "b200"
    assert any("float8/MX training (6 MXFP8Linear)" in line for line in trace.limitations)


@pytest.mark.parametrize("gpu", ["h100-80gb", "a100-80gb"])
def test_llama3_8b_mxfp8_is_refused_below_sm100_in_one_line(gpu):
    with pytest.raises(TorchtitanError) as info:
        _run(MXFP8, gpu)
    message = str(info.value)
    assert "\n" not in message
    sm = {"h100-80gb": "sm90", "a100-80gb": "sm80"}[gpu]
    assert message == (
        f"--module/--config: gpu={gpu!r} ({sm}) refused, as on the card: MXFP8 is only supported on SM100 or later "
        "architectures"
    )


def test_float8_runs_on_an_h100_and_is_refused_on_an_a100():
    trace = _run(FLOAT8, "h100-80gb")
    # debugmodel: wqkv, wo, w1, w2, w3 and the head, every dim a multiple of 16
    assert trace.metadata["torchtitan"]["quantization"] == {"Float8Linear": 6}
    with pytest.raises(TorchtitanError, match=r"^--module/--config: gpu='a100-80gb' \(sm80\) refused, as on the "
                       r"card: Failed to swap to Float8Linear because float8 is only supported on NVIDIA SM89"):  # fmt: skip
        _run(FLOAT8, "a100-80gb")


@pytest.mark.parametrize(
    ("config", "gpu", "refused"),
    [(MXFP8, "h100-80gb", "MXFP8"), (FLOAT8, "a100-80gb", "Failed to swap to Float8Linear")],
)
def test_the_command_refuses_on_the_gpu_it_is_given_with_exit_2(config, gpu, refused, capsys, tmp_path):
    rc, out, err = cli(
        [
            "torchtitan",
            *config,
            "--gpu",
            gpu,
            "--n-layers",
            "1",
            "--output-dir",
            str(tmp_path),
            "--in-process",
        ],
        capsys,
    )
    assert rc == 2
    lines = err.strip().splitlines()
    assert (
        len(lines) == 1
        and f"gpu={gpu!r} (sm" in lines[0]
        and f"refused, as on the card: {refused}" in lines[0]
    )


def test_the_command_runs_float8_on_an_h100(capsys, tmp_path):
    rc, out, err = cli(
        ["torchtitan", *FLOAT8, "--gpu", "h100-80gb", "--world-size", "2", "--n-layers", "1",
         "--output-dir", str(tmp_path), "--in-process", "--no-stacks"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert "fits in 79.11 GiB on the device" in out  # the h100-80gb preset's capacity
    report = json.loads((tmp_path / "rank_0" / "rank_0_memory.json").read_text())
    assert report["metadata"]["torchtitan"]["quantization"] == {"Float8Linear": 6}
    assert report["metadata"]["cuda"]["gpu"]["name"] == "h100-80gb"
