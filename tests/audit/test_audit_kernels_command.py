"""``hyperdryrun audit-kernels``: the table, the comparison against a reference, recording one, and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyperdryrun.cli import OneLineParser
from hyperdryrun.commands import audit_kernels

REFERENCE = Path(__file__).parent / "fixtures" / "cuda_kernels.json"


def run(argv: list[str]) -> int:
    parser = OneLineParser(prog="hyperdryrun")
    audit_kernels.register(parser.add_subparsers(dest="command", parser_class=OneLineParser))
    args = parser.parse_args(["audit-kernels", *argv])
    return args.func(args)


def test_without_a_reference_it_prints_every_audited_difference(capsys, monkeypatch):
    from hyperdryrun.world.cuda_target import DIFFERENCES

    monkeypatch.setenv("COLUMNS", "2000")  # one table row per line
    assert run([]) == 0
    out = capsys.readouterr().out
    for d in DIFFERENCES:
        assert d.layer.split(" (")[0] in out


def test_the_titles_name_the_target_the_reference_and_the_simulation_in_words(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")
    assert run(["--reference", str(REFERENCE), "--layers", "silu_bf16"]) == 0
    out = capsys.readouterr().out
    simulated = f"simulated: torch {torch.__version__} on cpu"
    # the fixture's own fields: torch_version 2.13.0+cu130, cuda_target sm [9, 0], cudnn 92000, cuda 13000
    assert f"CPU vs CUDA kernels · CUDA target: sm90 (h100-80gb), cuDNN 9.20, CUDA 13.0 · {simulated}" in out
    assert f"CUDA reference: torch 2.13.0+cu130, sm90, cuDNN 9.20 · {simulated}" in out
    assert "{" not in out.split("\n")[0] and "'sm'" not in out  # no raw dict as a title


def test_help_describes_the_command_and_that_record_needs_the_cuda_wheel(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_info:
        run(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "where CPU kernels allocate or save for backward differently from CUDA's" in out
    assert "--record FILE" in out and "needs the CUDA wheel of torch" in out


def test_the_shipped_reference_matches_and_an_unrecordable_layer_is_skipped(capsys):
    assert (
        run(
            [
                "--reference",
                str(REFERENCE),
                "--layers",
                "llama_block_bf16",
                "sdpa_bool_mask_bf16",
                "sgd_fused",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "llama_block_bf16" in out and "skipped" in out and "DIFF" not in out


def test_a_reference_that_disagrees_exits_1_naming_the_layer(tmp_path, capsys):
    data = json.loads(REFERENCE.read_text())
    data["layers"]["silu_bf16"]["forward"][0][1] = [12288 + 2]  # one more bf16 element than silu allocates
    bad = tmp_path / "ref.json"
    bad.write_text(json.dumps(data))
    assert run(["--reference", str(bad), "--layers", "silu_bf16", "gelu_bf16"]) == 1
    captured = capsys.readouterr()
    assert "DIFF" in captured.out
    assert captured.err.strip() == "hyperdryrun: audit-kernels: 1 layer(s) differ: silu_bf16"


@pytest.mark.parametrize(
    "content,expected",
    [
        (None, "no such file"),
        ('{"schema_version": 99, "layers": {}}', "schema_version=99"),
        ("not json", "invalid or truncated JSON at line 1 column 1"),
        ("[1, 2]", "a JSON list, expected an object with schema_version and layers"),
        ('"cuda"', "a JSON string"),
        ('{"schema_version": 1, "layers": [1]}', "layers: expected an object"),
        ('{"schema_version": 1, "layers": {"silu_bf16": [1]}}', "layers: expected an object"),
    ],
    ids=["missing", "schema", "not-json", "list", "string", "layers-list", "layer-record-list"],
)
def test_a_bad_reference_file_is_a_one_line_error_naming_the_flag_and_file_and_exit_2(
    tmp_path, capsys, content, expected
):
    path = tmp_path / "ref.json"
    if content is not None:
        path.write_text(content)
    assert run(["--reference", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # the error comes before the table (issue 30, item 10)
    assert err.startswith(f"hyperdryrun: error: --reference {path}: ") and expected in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_layer_the_catalogue_lacks_is_exit_2_naming_it_and_listing_the_known_ones(capsys):
    from hyperdryrun.audit import LAYERS

    assert run(["--layers", "nope"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before printing anything
    err = captured.err
    assert err.startswith("hyperdryrun: error: --layers: unknown layer 'nope' (known: ")
    assert err.count("\n") == 1 and all(name in err for name in LAYERS)


def test_an_unknown_layer_with_a_reference_is_refused_the_same_way(capsys):
    assert run(["--reference", str(REFERENCE), "--layers", "silu_bf16", "no_such_layer"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyperdryrun: error: --layers: unknown layer 'no_such_layer' (known: ")
    assert err.count("\n") == 1


def test_layers_without_a_reference_or_record_is_an_error_rather_than_ignored(capsys):
    assert run(["--layers", "silu_bf16"]) == 2
    err = capsys.readouterr().err
    assert "--layers" in err and "--reference" in err and err.count("\n") == 1


def test_record_and_reference_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(["--record", "a.json", "--reference", str(REFERENCE)])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="the CPU wheel refuses --record")
def test_record_on_the_cpu_wheel_says_it_needs_the_cuda_wheel_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "ref.json"
    assert run(["--record", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hyperdryrun: error: --record {out}: needs the CUDA wheel of torch")
    assert torch.__version__ in err and err.count("\n") == 1
    assert not out.exists()


def test_record_writes_what_the_audit_records_on_the_cuda_wheel(tmp_path, capsys, monkeypatch):
    # The CUDA wheel's part (fake "cuda" recording) cannot run here; what the command does around it can: the record
    # of the named layers is written as sorted, indented JSON, like the shipped fixture.
    import hyperdryrun.audit as audit

    calls = []

    def fake_record(device, backward, names):
        calls.append((device, backward, names))
        return {"schema_version": audit.SCHEMA_VERSION, "layers": {n: {"saved": []} for n in names}}

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(audit, "record", fake_record)
    out = tmp_path / "sub" / "ref.json"
    assert run(["--record", str(out), "--layers", "silu_bf16", "gelu_bf16"]) == 0
    assert calls == [("cuda", "walk", ["silu_bf16", "gelu_bf16"])]
    assert capsys.readouterr().out.strip() == f"recorded 2 layers to {out}"
    written = out.read_text()
    assert json.loads(written)["layers"] == {"gelu_bf16": {"saved": []}, "silu_bf16": {"saved": []}}
    assert written.startswith('{\n "layers": {\n  "gelu_bf16"') and written.endswith("}\n")


@pytest.mark.parametrize(
    ("make", "env", "expected"),
    [
        (lambda p: "/dev/zero", {"HYPERDRYRUN_MAX_INPUT_BYTES": "4096"}, "larger than the limit of 4096 B"),
        (lambda p: str(REFERENCE), {"HYPERDRYRUN_MAX_INPUT_BYTES": "100"}, "HYPERDRYRUN_MAX_INPUT_BYTES"),
        (
            lambda p: (p.write_text("[" * 100_000 + "]" * 100_000), str(p))[1],
            {},
            "nested deeper than 64 levels",
        ),
        (
            lambda p: (p.write_text('{"a":' * 70 + "1" + "}" * 70), str(p))[1],
            {},
            "nested deeper than 64 levels",
        ),
    ],
    ids=["dev-zero", "env-limit", "deep-list", "deep-object"],
)
def test_a_reference_is_read_within_the_input_limits(make, env, expected, tmp_path, capsys, monkeypatch):
    """Issue 30, item 10: /dev/zero grew to 23 GB; the variable was ignored; deep nesting was a RecursionError."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    path = make(tmp_path / "ref.json")
    assert run(["--reference", path]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and expected in err, err


def test_batchnorm_an_audited_unmodelled_difference_is_known_when_its_bytes_agree(capsys, monkeypatch):
    """The shipped reference (the README's command): BatchNorm runs cudnn_batch_norm on CUDA, native_batch_norm
    here; the DIFFERENCES table says the bytes agree and only the op's name differs, so the row is "known" and the
    exit code 0. The byte totals are still compared."""
    monkeypatch.setenv("COLUMNS", "2000")
    assert (
        run(["--reference", str(REFERENCE), "--layers", "batchnorm_train_fp32", "batchnorm_eval_fp32"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("│ known ") == 2 and "DIFF" not in out
    assert "audited difference 'BatchNorm'" in out


def test_batchnorm_bytes_that_disagree_are_still_a_diff(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")
    data = json.loads(REFERENCE.read_text())
    forward = data["layers"]["batchnorm_eval_fp32"]["forward"]
    assert forward[0] == ["cudnn_batch_norm", [16384]]  # 2 x 32 x 8 x 8 fp32 elements
    forward[0][1] = [16384 + 4]
    bad = tmp_path / "ref.json"
    bad.write_text(json.dumps(data))
    assert run(["--reference", str(bad), "--layers", "batchnorm_eval_fp32"]) == 1
    captured = capsys.readouterr()
    assert "DIFF" in captured.out and "forward_bytes: reference 16388, simulated 16384" in captured.out
