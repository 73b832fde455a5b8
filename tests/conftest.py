"""Shared helpers: build a job config from a few overrides and dry-run it."""

from __future__ import annotations

import pytest

from hyperdryrun.config import build_config
from hyperdryrun.recipe import run_job


def job(**over):
    """A JobConfig for llama-tiny with nested overrides given as ``section__field=value``."""
    data: dict = {"model": {"name": "llama-tiny"}, "training": {"seq_len": 64}}
    for key, value in over.items():
        if "__" in key:
            section, field = key.split("__", 1)
            data.setdefault(section, {})[field] = value
        else:
            data[key] = value
    return build_config(data)


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``hyperdryrun <argv>`` in-process: (exit code, stdout, stderr); argparse's usage errors give their exit code."""
    from hyperdryrun.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def dry_run(**over):
    return run_job(job(**over))


@pytest.fixture
def tiny_trace():
    return dry_run(world__world_size=2)


SLOW = (
    "tests/accuracy/",
    "tests/commands/test_exit_codes.py",
    "tests/commands/test_routing.py",
    "tests/integrations/test_torchtitan",
    "tests/measure/",
    "tests/models/test_hf.py",
    "tests/parallel/test_context.py",
    "tests/parallel/test_expert.py",
    "tests/parallel/test_pipeline.py",
    "tests/test_activation_checkpointing.py",
    "tests/test_benchmarks.py",
    "tests/test_cancellation.py",
    "tests/test_determinism.py",
    "tests/test_readme.py",
    "tests/test_run_ranks.py",
    "tests/test_runner.py",
    "tests/search/test_bounds.py",
    "tests/search/test_classes.py",
    "tests/search/test_executors.py",
    "tests/search/test_extrapolate.py",
    "tests/search/test_fit.py",
    "tests/viz/test_browser.py",
)
"""Test files that run real steps, child processes or a browser: marked ``slow``, so ``pytest -m "not slow"`` is the
inner loop (CI runs everything)."""


SLOW_TESTS = frozenset(
    {
        "tests/allocator/test_replay.py::test_a_dry_run_replays_with_reserved_bytes_covering_the_live_bytes",
        "tests/audit/test_audit_kernels_command.py::test_a_bad_reference_file_is_a_one_line_error_naming_the_flag_and_file_and_exit_2",
        "tests/audit/test_audit_kernels_command.py::test_the_shipped_reference_matches_and_an_unrecordable_layer_is_skipped",
        "tests/audit/test_backward.py::test_walking_the_autograd_graph_issues_the_same_backward_ops_as_the_engine",
        "tests/audit/test_reference.py::test_the_runtime_does_not_import_the_audit_package",
        "tests/commands/test_host_cost.py::test_no_memory_check_measures_anyway",
        "tests/commands/test_host_cost.py::test_ten_million_ranks_in_a_real_process_stop_within_a_minute",
        "tests/commands/test_host_cost.py::test_the_estimate_bounds_what_a_measured_step_really_holds",
        "tests/integrations/test_child.py::test_a_segmentation_fault_is_named_by_its_signal",
        "tests/integrations/test_compile.py::test_inductor_region_saves_for_backward_what_a_real_compiled_step_saves",
        "tests/integrations/test_compile.py::test_region_with_another_backend_runs_eagerly_with_the_eager_bytes_and_a_limitation",
        "tests/integrations/test_compile.py::test_run_compile_compiles_every_decoder_block_of_the_preset_or_hf_model",
        "tests/integrations/test_compile.py::test_accuracy_md_s_compiled_against_eager_figures_are_what_run_prints",
        "tests/integrations/test_flex.py::test_compiled_block_mask_allocates_only_the_block_mask_tensors",
        "tests/integrations/test_flex.py::test_flex_forward_outputs_and_saved_tensors",
        "tests/integrations/test_flex.py::test_selective_checkpointing_saves_or_recomputes_the_flex_call",
        "tests/models/test_moe.py::test_dry_run_peak_equals_real_cpu_execution_of_the_same_moe_step",
        "tests/models/test_moe.py::test_preset_parameter_counts_match_the_published_shapes",
        "tests/parallel/test_train_spec.py::test_a_registered_family_runs_through_config_and_recipe",
        "tests/report/test_device_memory.py::test_a_capacity_that_fits_reports_device_headroom",
        "tests/report/test_device_memory.py::test_alloc_conf_comes_from_the_job_else_from_the_variable",
        "tests/report/test_device_memory.py::test_allocated_reserved_device_are_ordered_and_the_summary_has_every_device_key",
        "tests/report/test_device_memory.py::test_gpu_presets_set_the_capacity_the_sdpa_kernel_and_the_cublas_workspace",
        "tests/report/test_device_memory.py::test_runtime_cost_settings_come_from_the_job_else_the_variables",
        "tests/report/test_device_memory.py::test_the_console_shows_allocated_reserved_and_device_at_a_glance",
        "tests/report/test_device_memory.py::test_the_oom_verdict_is_on_device_bytes_for_a_job_that_fits_in_allocated_bytes",
        "tests/report/test_device_memory.py::test_without_a_gpu_or_capacity_there_is_no_verdict",
        "tests/report/test_device_memory.py::test_without_outside_costs_the_caching_allocator_tips_it",
        "tests/report/test_reader.py::test_a_csv_that_is_not_the_reports_own_is_refused",
        "tests/report/test_reader.py::test_a_report_from_before_the_hash_still_loads",
        "tests/report/test_reader.py::test_a_report_loads_with_its_own_csv",
        "tests/report/test_reader.py::test_compare_of_a_mismatched_pair_is_one_line_exit_2",
        "tests/test_architecture.py::test_no_import_cycles",
        "tests/test_bytes.py::test_bf16_storage_halves_parameter_and_state_bytes",
        "tests/test_bytes.py::test_buffers_are_the_rope_table_of_the_sequence_length",
        "tests/test_bytes.py::test_fused_adamw_keeps_its_step_counters_on_the_device",
        "tests/test_bytes.py::test_one_rank_holds_exactly_twice_the_parameter_bytes_of_each_of_two",
        "tests/test_bytes.py::test_sgd_with_momentum_keeps_one_state_per_parameter",
        "tests/test_bytes.py::test_tensor_parallel_shards_each_weight_along_its_plan_dimension",
        "tests/test_bytes.py::test_tied_embeddings_store_the_shared_table_once",
        "tests/test_bytes.py::test_uneven_fsdp_shards_give_padded_params_and_grads_and_unpadded_optimizer_states",
        "tests/test_cli.py::test_bad_input_is_one_line_error_and_writes_nothing",
        "tests/test_cli.py::test_flags_override_yaml",
        "tests/test_cli.py::test_large_device_memory_fits_and_exit_0",
        "tests/test_cli.py::test_real_process_exit_code_and_one_line_stderr",
        "tests/test_cli.py::test_successful_run_writes_exactly_the_rank_files",
        "tests/test_cli.py::test_tiny_device_memory_is_oom_and_exit_1",
        "tests/test_cli.py::test_torchrun_env_gives_rank_when_no_rank_flag",
        "tests/test_cli.py::test_unwritable_output_dir_is_one_line_error",
        "tests/test_compare.py::test_a_csv_alone_rebuilds_the_reports_peak_and_phase_peaks",
        "tests/test_compare.py::test_a_report_against_itself_has_zero_error",
        "tests/test_compare_reserved.py::test_compare_puts_a_snapshot_beside_a_dry_run_on_reserved_fragmentation_and_pools",
        "tests/test_compare_reserved.py::test_two_sides_without_the_allocator_have_no_reserved_section",
        "tests/test_engine.py::test_dtensor_speedup_changes_no_block",
        "tests/test_engine.py::test_dtensor_speedup_patch_undone_after_run_and_after_failure",
        "tests/test_engine.py::test_one_plan_gives_the_same_residents_and_roles_in_the_dry_run_and_measured",
        "tests/test_engine.py::test_prepare_reaches_the_steady_state_of_step_two_on_fake_and_on_real_tensors",
        "tests/test_engine.py::test_run_and_measure_execute_the_same_recipe_plan",
        "tests/test_fuzz.py::test_a_sample_of_hostile_files_in_a_capped_process",
        "tests/test_fuzz.py::test_any_block_csv_is_read_or_refused_on_one_line",
        "tests/test_fuzz.py::test_any_bytes_are_refused_on_one_line",
        "tests/test_fuzz.py::test_any_chrome_trace_is_read_or_refused_on_one_line",
        "tests/test_fuzz.py::test_any_report_json_is_read_or_refused_on_one_line",
        "tests/test_fuzz.py::test_any_snapshot_pickle_is_read_or_refused_on_one_line",
        "tests/test_fuzz.py::test_any_yaml_job_file_is_accepted_or_refused_on_one_line",
        "tests/test_fuzz.py::test_any_environment_is_accepted_or_refused_on_one_line_and_keeps_the_report",
        "tests/test_fuzz.py::test_any_run_flags_are_accepted_or_refused_on_one_line_and_keep_the_report",
        "tests/test_fuzz.py::test_any_hf_config_is_accepted_or_refused_on_one_line",
        "tests/test_fuzz.py::test_any_output_path_is_written_whole_or_refused_before_anything_is_written",
        "tests/test_fuzz.py::test_hostile_variables_and_flags_in_a_capped_process",
        "tests/test_hostile_inputs.py::test_10_a_bad_hf_config_names_the_file_and_field",
        "tests/test_hostile_inputs.py::test_12_torch_warnings_of_the_step_go_to_the_limitations_once_with_their_count",
        "tests/test_hostile_inputs.py::test_7_shared_references_are_counted_before_anything_is_walked",
        "tests/test_hostile_inputs.py::test_bombs_in_a_capped_process_are_refused_quickly",
        "tests/test_hostile_inputs.py::test_yaml_nested_20000_deep_is_one_line_naming_the_limit",
        "tests/test_smoke.py::test_blocks_reconstruct_tracker_peak_exactly",
        "tests/trace/test_blocks.py::test_blocks_reconstruct_the_peak_exactly",
        "tests/trace/test_blocks.py::test_report_peak_live_set_is_the_blocks_alive_at_the_peak_largest_first",
        "tests/trace/test_streams.py::test_a_step_communicates_on_its_mesh_groups_only",
        "tests/viz/test_html.py::test_the_page_loads_nothing_from_outside",
        "tests/viz/test_plots.py::test_a_reserved_line_is_drawn_in_its_colour",
        "tests/viz/test_plots.py::test_every_rank_gets_a_timeline_and_a_breakdown_and_the_ranks_share_one_axis",
        "tests/viz/test_plots.py::test_report_plot_writes_the_page_and_the_pngs",
        "tests/viz/test_snapshot.py::test_torch_memory_viz_renders_the_snapshot",
        "tests/viz/test_snapshot.py::test_torch_memory_viz_stats_accounts_every_byte",
        "tests/world/test_fsdp_patches.py::test_unsharded_accumulated_gradients_under_pipelining_are_gradients",
        "tests/world/test_kernels.py::test_layer_allocates_and_saves_exactly_what_the_cuda_reference_does",
    }
)
"""Single tests (all their parameters) that took over 1.5 s in a timed run of the rest (`pytest -m "not slow"
--durations=0`): also marked ``slow``, so the inner loop stays under a minute."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs real steps, child processes or a browser (CI runs them)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path.startswith(SLOW) or item.nodeid.split("[", 1)[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


_ENVIRONMENT_NOT_OURS = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})
"""Set by pytest itself, and by torch the first time anything asks Inductor for its cache directory
(``torch._inductor.runtime.cache_dir_utils.cache_dir`` writes it into the environment; torch.profiler does on its
first profile), not by anything a test or a simulation does."""


def _process_globals() -> dict:
    """What one test could leave behind for the next in the same process: global module and optimizer hooks,
    dispatch and function modes, saved-tensor hooks, grad/anomaly mode, default dtype and device, a running
    profiler, a Python profile/trace function, the environment. Cheap enough to read around every test."""
    import os
    import sys

    import torch
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    hooks = {
        name: len(getattr(nn_module, name))
        for name in dir(nn_module)
        if name.startswith("_global_") and name.endswith("hooks")
    }
    return {
        **hooks,
        "optimizer pre hooks": len(optim_module._global_optimizer_pre_hooks),
        "optimizer post hooks": len(optim_module._global_optimizer_post_hooks),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "function modes": torch._C._len_torch_function_stack(),
        "saved tensors hooks": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
        "grad enabled": torch.is_grad_enabled(),
        "anomaly mode": torch.is_anomaly_enabled(),
        "default dtype": torch.get_default_dtype(),
        "default device": str(torch.get_default_device()),
        "profiler": torch._C._autograd._profiler_enabled(),
        "sys.getprofile": sys.getprofile(),
        "environment": {k: v for k, v in os.environ.items() if k not in _ENVIRONMENT_NOT_OURS},
    }


@pytest.fixture(autouse=True)
def _leaves_the_process_as_it_found_it():
    """Every test leaves the process's globals as it found them, so that no test's outcome depends on which tests
    ran before it in the same process (an order-dependent failure is found at the test that leaks, not later)."""
    before = _process_globals()
    yield
    after = _process_globals()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        detail = {k: (before.get(k), after.get(k)) for k in changed if k != "environment"}
        if "environment" in changed:
            b, a = before["environment"], after["environment"]
            detail["environment"] = {
                k: (b.get(k), a.get(k)) for k in b.keys() | a.keys() if b.get(k) != a.get(k)
            }
        pytest.fail(f"the test left process globals changed: {detail}", pytrace=False)
