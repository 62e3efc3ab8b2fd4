"""The suite's tiers: which tests start processes (``SPAWNING``), and a guard that fails a test of
the fast tier that starts one anyway. ``DATACACHE_TIER_PROBE=FILE`` records such tests in FILE
instead of failing them (how ``SPAWNING`` is refreshed: run the suite once with it)."""
from __future__ import annotations

import multiprocessing.util
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["HEAVIEST_FIRST", "SPAWNING", "forbid_processes", "spawning", "weight_order"]

# test files (every test in them) or test functions (file::name, any parameters) that start processes
SPAWNING: frozenset[str] = frozenset({
    "tests/test_api.py::test_the_wheel_installs_no_generic_top_level_name",
    "tests/test_api.py::test_version_and_cli_help",
    "tests/test_as_user.py",
    "tests/test_batching.py::test_batch_size_on_dataset_and_dataloader_is_refused",
    "tests/test_batching.py::test_dataloader_batches_are_default_collated",
    "tests/test_batching.py::test_len_is_what_comes",
    "tests/test_batching.py::test_ranks_yield_equal_exact_batch_counts",
    "tests/test_batching.py::test_resume_with_another_batch_size_is_exactly_once",
    "tests/test_bench.py::test_bench_datacache_tiny",
    "tests/test_bench.py::test_bench_shuffle_scenario_and_readme_regeneration_tiny",
    "tests/test_bench.py::test_scale_model_and_plan_scale_small",
    "tests/test_bench_nodes.py::test_each_node_writes_its_own_profile_and_they_are_joined",
    "tests/test_bench_nodes.py::test_simulated_nodes_do_not_share_dev_shm",
    "tests/test_bench_scenarios.py",
    "tests/test_cache.py::test_cache_is_usable_in_a_forked_child_and_in_the_parent_after",
    "tests/test_cache.py::test_crash_reconciliation_and_ssd_reverification",
    "tests/test_cache.py::test_fetcher_killed_mid_write_leaves_no_partial_entry",
    "tests/test_cache.py::test_fork_spares_lmdb_transactions_in_flight_in_other_threads",
    "tests/test_cache.py::test_pinned_entry_is_never_evicted_even_by_another_process",
    "tests/test_cache.py::test_processes_joining_while_the_first_reconciles_keep_their_tiers",
    "tests/test_cache.py::test_same_missing_key_from_8_processes_is_fetched_once",
    "tests/test_cache.py::test_stats_are_summed_across_processes",
    "tests/test_cache.py::test_stress_budgets_bytes_and_no_deadlock",
    "tests/test_cache.py::test_stress_each_key_fetched_once_while_resident",
    "tests/test_cache.py::test_waiter_takes_over_when_fetcher_is_killed",
    "tests/test_cli_messages.py",
    "tests/test_dataset.py::test_abandon_and_close",
    "tests/test_dataset.py::test_batched_mode_equal_batch_counts",
    "tests/test_dataset.py::test_dataloader_epochs_exactly_once",
    "tests/test_dataset.py::test_fetch_error_reaches_consumer",
    "tests/test_dataset_edges.py::test_a_skipped_shard_warns_and_counts_once_per_epoch_for_all_workers",
    "tests/test_dataset_edges.py::test_automatic_epochs_resume_exactly_and_go_on",
    "tests/test_dataset_edges.py::test_len_of_the_dataset_stays_its_sample_count_under_the_loader",
    "tests/test_dataset_edges.py::test_stats_give_the_datasets_own_figures_first",
    "tests/test_dataset_edges.py::test_without_set_epoch_each_iteration_reads_the_next_epoch",
    "tests/test_demo.py::test_demo_prints_both_epochs_against_one_compute_bound",
    "tests/test_fastpath.py::test_a_full_dev_shm_gives_the_batch_or_the_error_never_a_hang",
    "tests/test_fastpath.py::test_batches_through_rings_are_exact_even_when_all_are_kept",
    "tests/test_fastpath.py::test_shared_ring_file_left_by_killed_processes_is_removed",
    "tests/test_faults.py::test_corrupt_cache_file_is_refetched_after_a_restart",
    "tests/test_faults.py::test_store_killed_mid_epoch_and_restarted_within_the_retry_window",
    "tests/test_faults.py::test_stress_tool_runs_clean_for_10_seconds",
    "tests/test_field_types.py::test_bytes_views_are_packed_zero_copy_views",
    "tests/test_field_types.py::test_every_field_type_is_default_collated_exactly_once",
    "tests/test_field_types.py::test_gathered_batches_equal_the_per_sample_paths",
    "tests/test_field_types.py::test_pin_memory_gives_the_same_batches_pinned_where_torch_can",
    "tests/test_field_types.py::test_resume_mid_epoch_continues_the_same_batches",
    "tests/test_field_types.py::test_warm_shuffle_quality_is_a_random_permutations",
    "tests/test_fork_heap.py",
    "tests/test_fork_locks.py",
    "tests/test_hostile.py::test_zstd_bomb_in_a_dataset_is_refused_in_bounded_memory",
    "tests/test_loader.py::test_a_dataset_in_batched_mode_keeps_its_size",
    "tests/test_loader.py::test_a_loop_left_early_then_the_next_epoch_reads_every_sample_once",
    "tests/test_loader.py::test_a_workers_error_reaches_the_loop_through_the_read_ahead",
    "tests/test_loader.py::test_an_ended_iterator_read_ahead_stays_ended",
    "tests/test_loader.py::test_an_unshuffled_state_saved_before_turns_resumes_its_contiguous_shares",
    "tests/test_loader.py::test_batch_size_becomes_the_datasets_batched_mode",
    "tests/test_loader.py::test_batches_read_ahead_are_the_same_batches_and_resume_exactly",
    "tests/test_loader.py::test_collate_fn_runs_in_the_dataset",
    "tests/test_loader.py::test_creating_and_iterating_it_warns_nothing",
    "tests/test_loader.py::test_its_state_continues_in_torchdatas_loader_and_back",
    "tests/test_loader.py::test_plain_torch_dataloader_over_samples_still_works",
    "tests/test_loader.py::test_resume_at_midpoints",
    "tests/test_loader.py::test_resume_through_it_is_exactly_once",
    "tests/test_loader.py::test_resume_with_uneven_workers_near_the_end",
    "tests/test_loader.py::test_under_a_profiler_each_batch_is_a_dataloader_range",
    "tests/test_loader.py::test_unshuffled_batches_come_in_the_written_order",
    "tests/test_loader.py::test_unshuffled_samples_batched_by_torch_come_in_the_written_order",
    "tests/test_mapped.py::test_planned_order_with_a_sampler",
    "tests/test_node_mix.py::test_a_next_epoch_that_cannot_start_ahead_starts_as_before",
    "tests/test_node_mix.py::test_a_persistent_worker_plans_its_next_epoch_while_it_waits",
    "tests/test_node_mix.py::test_warm_epoch_is_node_mixed_through_workers",
    "tests/test_parquet_batches.py",
    "tests/test_peers.py::test_a_standby_process_takes_over_the_nodes_server",
    "tests/test_plan_share.py::test_a_stuck_computer_never_blocks_the_node",
    "tests/test_plan_share.py::test_the_assignment_is_computed_once_per_node_and_mapped_by_the_others",
    "tests/test_reader_writable.py::test_dataloader_workers_print_no_not_writable_warning",
    "tests/test_reader_writable.py::test_in_place_op_on_a_sample_works_and_leaves_the_file_unchanged",
    "tests/test_readers.py::test_read_after_fork",
    "tests/test_readers.py::test_tar_huge_longname_header_does_not_allocate",
    "tests/test_readers.py::test_zstd_bomb_small_declared_length",
    "tests/test_readers.py::test_zstd_bomb_without_content_size",
    "tests/test_readers.py::test_zstd_huge_declared_raw_length",
    "tests/test_resume.py::test_resume_batched_dataset",
    "tests/test_resume.py::test_resume_elastic",
    "tests/test_resume.py::test_resume_elastic_into_dataloader_workers",
    "tests/test_resume.py::test_resume_elastic_then_same_world_from_workers",
    "tests/test_resume.py::test_resume_keeps_rank",
    "tests/test_resume.py::test_resume_small_window",
    "tests/test_resume.py::test_resume_stateful_dataloader",
    "tests/test_resume_workers.py::test_exactly_once_at_midpoints",
    "tests/test_resume_workers.py::test_exactly_once_at_midpoints_of_a_narrowing_part_mix",
    "tests/test_resume_workers.py::test_exactly_once_at_midpoints_of_a_part_mix",
    "tests/test_resume_workers.py::test_exactly_once_from_workers",
    "tests/test_resume_workers.py::test_exactly_once_from_workers_batched",
    "tests/test_resume_workers.py::test_loader_state_into_another_layout_is_refused",
    "tests/test_resume_workers.py::test_rank_states_that_disagree_are_refused",
    "tests/test_resume_workers.py::test_ranks_at_different_steps_resume_their_own_states",
    "tests/test_resume_workers.py::test_snapshot_interval_is_refused",
    "tests/test_resume_workers.py::test_state_dict_in_main_process_while_workers_iterate",
    "tests/test_rounds.py::test_torch_takes_the_workers_batches_in_turn",
    "tests/test_shared_cache.py::test_a_forked_child_sees_its_parents_plan_without_releasing_it",
    "tests/test_shared_cache.py::test_plans_are_shared_between_processes_and_dropped_when_their_process_dies",
    "tests/test_slowlink.py::test_s3server_cli_starts_a_second_server_and_stops_on_sigterm",
    "tests/test_slowlink.py::test_s3server_reports_a_failed_start",
    "tests/test_slowlink.py::test_slowlink_cli",
    "tests/test_stash.py::test_a_part_mix_whose_padding_repeats_a_sample_in_one_consumer",
    "tests/test_storage.py::test_fork_child_reads_through_parent_store",
    "tests/test_storage.py::test_round_trip_sizes",
    "tests/test_store_urls.py::test_a_url_with_one_slash_is_refused_not_read_as_a_local_folder",
    "tests/test_store_urls.py::test_ls_with_a_typo_in_the_endpoint_fails_in_one_line_naming_endpoint_and_cause",
    "tests/test_throttle.py::test_window_halves_on_throttling_grows_on_success_and_a_killed_holder_is_forgotten",
    "tests/test_worker_start.py",
})


# The files whose tests take longest together (20 s or more), heaviest first: per-file totals of
# `pytest --durations=0` (or --junitxml), the mean of two busy `make test` runs; refresh when a file's
# total moves a lot. `make test` runs each file on one xdist worker (--dist loadfile); these go out first
# so that the last files handed out are short ones and the workers finish together (xdist's default,
# most tests first, sent these 1-3-test files last: a ~1 min tail on one worker). Unlisted files follow
# in collection order.
HEAVIEST_FIRST: tuple[str, ...] = (
    "tests/test_mix_resume.py",
    "tests/test_resume_workers.py",
    "tests/test_bench_scenarios.py",
    "tests/test_resume.py",
    "tests/test_bench.py",
    "tests/test_cli.py",
    "tests/test_loader.py",
    "tests/test_partial_restart.py",
    "tests/test_throttle.py",
    "tests/test_bench_derived.py",
    "tests/test_as_user.py",
    "tests/test_multinode.py",
    "tests/test_batching.py",
    "tests/test_stop.py",
    "tests/test_peers_nodes.py",
    "tests/test_torchrun.py",
    "tests/test_spawn.py",
    "tests/test_api.py",
    "tests/test_reader_writable.py",
    "tests/test_mix.py",
    "tests/test_faults.py",
    "tests/test_shared_cache.py",
    "tests/test_demo.py",
    "tests/test_env_config.py",
    "tests/test_store_urls.py",
    "tests/test_fastpath.py",
    "tests/test_field_types.py",
    "tests/test_node_mix.py",
    "tests/test_dataset.py",
    "tests/test_dataset_edges.py",
)


def weight_order(nodeids: list[str]) -> list[int]:
    """The indexes of ``nodeids`` with the files of ``HEAVIEST_FIRST`` first, in its order; a file's
    tests keep their order, and so do the unlisted files (a stable sort: every test stays, once)."""
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    return sorted(range(len(nodeids)), key=lambda i: rank.get(nodeids[i].partition("::")[0], len(rank)))


def spawning(nodeid: str) -> bool:
    """True if the test ``nodeid`` is listed in ``SPAWNING`` (by file or by function)."""
    path, _, rest = nodeid.partition("::")
    func = rest.split("[")[0]
    return path in SPAWNING or f"{path}::{func}" in SPAWNING


@contextmanager
def forbid_processes(nodeid: str) -> Iterator[None]:
    """Inside: starting a process (fork, spawn, subprocess) raises, naming the test to mark."""
    probe = os.environ.get("DATACACHE_TIER_PROBE")
    seen = []

    def guard(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if probe:
                seen.append(name)
                return real(*args, **kwargs)
            raise AssertionError(f"{nodeid} starts a process ({name}) but is in the fast tier: add it to "
                                 f"tests/helpers/tiers.py SPAWNING or mark it @pytest.mark.subprocess")
        return call

    saved = (os.fork, subprocess.Popen._execute_child, multiprocessing.util.spawnv_passfds)
    os.fork = guard("os.fork", saved[0])
    subprocess.Popen._execute_child = guard("subprocess", saved[1])
    multiprocessing.util.spawnv_passfds = guard("multiprocessing spawn", saved[2])
    try:
        yield
    finally:
        os.fork, subprocess.Popen._execute_child, multiprocessing.util.spawnv_passfds = saved
        if probe and seen:
            with open(probe, "a") as f:
                f.write(f"{nodeid}\t{seen[0]}\n")
