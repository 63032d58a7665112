#!/usr/bin/env python
"""Mutation check: breaks each feature on purpose and shows which tests notice.

Each break is a (file, exact source snippet, replacement) triple. For every break the
script copies the repository (keras_boost/, tests/, scripts/, setup.py) into a temporary
directory, replaces the snippet there (the working tree is never touched), runs the
tests named for that break with pytest, and records which failed. A break that no test
catches is a hole in the suite; a snippet that is no longer in the source (the code moved)
is an error of this list, reported loudly, so the list stays true.

Usage:
    scripts/mutation_check.py              # every break, then a table; exit 1 unless all caught
    scripts/mutation_check.py --list       # the breaks and their tests
    scripts/mutation_check.py --only NAME  # one break (repeatable)
    scripts/mutation_check.py --verify     # only check that every snippet is still found

Too slow for every CI run (about half an hour on 2 cores); run it before resolving an issue,
and add a break for every new feature. Results: docs/mutation_check.md.
"""

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("keras_boost", "tests", "scripts", "setup.py", "README.md", "docs")  # README: its commands are tests


@dataclasses.dataclass(frozen=True)
class Break:
    name: str
    what: str  # the feature broken, in words
    path: str  # file relative to the repository root
    snippet: str  # exact source text, found exactly once
    replacement: str
    tests: tuple  # pytest node ids that must catch it (the fewest, fastest ones)
    timeout: int = 600


BREAKS = (
    Break("no_averaging", "allreduce sums the gradients instead of averaging them",
          "keras_boost/distributed/collectives.py",
          "    return hvd.Average if average else hvd.Sum", "    return hvd.Sum",
          ("tests/test_multiprocess.py::test_two_workers_equal_one_process_with_twice_the_batch[gloo]",)),
    Break("broadcast_skipped", "no broadcast of rank 0's variables when fit starts",
          "keras_boost/fit/callbacks.py",
          "            distributed.broadcast_variables(variables, self.root_rank)",
          "            pass",
          ("tests/test_freeze_multiprocess.py::test_freeze_training_agrees_across_workers[gloo]",)),
    Break("no_overflow_skip", "a non-finite update is applied instead of skipped",
          "keras_boost/step/loop.py",
          "run_if(tf.logical_not(skip), lambda: self._apply(grads, variables, sums, in_cond=True))",
          "self._apply(grads, variables, sums)",
          ("tests/test_loss_scale.py::test_overflow_skips_the_whole_update_exactly",)),
    Break("loss_scale_never_updated", "the dynamic loss scale never halves nor grows",
          "keras_boost/stages/loss_scale.py",
          "        self.scale.assign(scale)\n", "        self.scale.assign(self.scale.value)\n",
          ("tests/test_loss_scale.py::test_scale_grows_after_window_and_respects_max",)),
    Break("loss_not_scaled", "the loss is not multiplied by the loss scale (gradients still divided)",
          "keras_boost/stages/loss_scale.py",
          "        return loss * tf.cast(self.scale, loss.dtype)", "        return loss",
          ("tests/test_loss_scale.py::test_scaled_step_equals_unscaled_step",)),
    Break("nan_guard_off", "the NaN guard lets a non-finite update through",
          "keras_boost/stages/nan_guard.py",
          "        skip = tf.logical_not(finite)\n", "        skip = tf.logical_and(finite, tf.logical_not(finite))\n",
          ("tests/test_model.py::test_nan_guard_stops_before_the_weights_are_touched",)),
    Break("accumulation_never_reset", "the accumulation window keeps its sums after an update",
          "keras_boost/stages/accumulation.py",
          "            acc.assign(tf.zeros_like(acc.value))", "            acc.assign(acc.value)",
          ("tests/test_accumulation.py::test_four_micro_batches_equal_one_batch_of_64",)),
    Break("accumulation_sum_not_mean", "the accumulated gradient is the window's sum, not its mean",
          "keras_boost/stages/accumulation.py",
          "        inverse = 1.0 / tf.cast(self.micro_step.value, tf.float32)", "        inverse = 1.0",
          ("tests/test_accumulation.py::test_four_micro_batches_equal_one_batch_of_64",)),
    Break("freezing_off", "every freeze group trains all variables (the schedule is still logged)",
          "keras_boost/stages/freeze/stage.py",
          "        return self.group_indices, self.current_group",
          "        return [self.group_indices[0]] * len(self.group_indices), self.current_group",
          ("tests/test_freeze_multiprocess.py::test_freeze_training_agrees_across_workers[gloo]",)),
    Break("freeze_schedule_stuck", "the freeze sequence never advances",
          "keras_boost/stages/freeze/stage.py",
          "        following = (self.position.value + 1) % self.plan.period",
          "        following = self.position.value",
          ("tests/test_freeze_step.py::test_logged_groups_follow_the_strategy_and_wrap_around",)),
    Break("group_run_too_long", "the per-group train function runs a whole steps_per_execution chunk in one group",
          "keras_boost/step/planning.py",
          "        return branch, max(1, min(limit, first + (updates - 1) * per_update))",
          "        return branch, limit",
          ("tests/test_freeze_step.py::test_per_group_functions_equal_the_switch_case_step",)),
    Break("centralization_off", "gradient centralization returns the gradients unchanged",
          "keras_boost/stages/centralization.py",
          "    def transform(self, grads, variables, sums=None):\n        if self.switch is None:\n"
          "            return self.apply(grads, variables, sums)",
          "    def transform(self, grads, variables, sums=None):\n        if self.switch is None:\n            return grads",
          ("tests/test_centralization.py::test_the_boost_step_applies_centralized_gradients",)),
    Break("gc_mean_of_the_wrong_axis", "gradient centralization divides each channel's sum by the channel count",
          "keras_boost/stages/centralization.py",
          "    return grad - sums / (grad.shape.num_elements() // grad.shape[-1])",
          "    return grad - sums / grad.shape[-1]",
          ("tests/test_centralization.py::test_centralized_gradients_match_numpy_and_others_are_untouched",)),
    Break("adasum_float32", "AdaSum's dot products and norms accumulated in float32, not float64",
          "keras_boost/stages/adasum_ops.py",
          "    a64 = tf.cast(a, tf.float64)\n    b64 = tf.cast(b, tf.float64)",
          "    a64 = tf.cast(a, tf.float32)\n    b64 = tf.cast(b, tf.float32)",
          ("tests/test_adasum_math.py",)),
    Break("adasum_is_average", "AdaSum's combine across groups is a plain average",
          "keras_boost/stages/adasum.py",
          "        combined = adasum_ops.combine(list(delta_weights), backend=self.combine_backend,\n"
          "                                      process_set=self.outer_set)",
          "        combined = distributed.grouped_allreduce(list(delta_weights), process_set=self.outer_set)",
          ("tests/test_adasum_training.py::test_adasum_training[2-gloo-1-exact]",)),
    Break("less_bn_keeps_every_bn", "LessBN removes no BatchNormalization",
          "keras_boost/graph/less_bn.py",
          "    removed_nodes, held = _plan_removals(graph)", "    removed_nodes, held = {}, {}",
          ("tests/test_less_bn.py::test_residual_cnn_keeps_the_last_branch_bn_and_the_stem",)),
    Break("elastic_restore_skipped", "elastic state restore leaves the variables as they are",
          "keras_boost/fit/elastic.py",
          "        for variable, value in zip(self.variables, self._values):\n            variable.assign(value)",
          "        pass",
          ("tests/test_elastic.py::test_state_restores_model_optimizer_and_boost_state",)),
    Break("sens_ignored", "the step ignores `sens`",
          "keras_boost/step/loop.py",
          "            target = loss * self.sens if self.sens != 1.0 else loss", "            target = loss",
          ("tests/test_model.py::test_sens_scales_the_gradient_like_the_seed",)),
    Break("distributed_optimizer_off", "a custom train_step's optimizer.apply does not average across workers",
          "keras_boost/fit/dropin.py",
          "        if distributed.size() > 1 and not distributed.in_boost_step():",
          "        if False:",
          ("tests/test_dropin_multiprocess.py::"
           "test_custom_train_step_on_two_workers_equals_one_process_with_the_global_batch[gloo]",)),
    Break("uneven_data_not_evened", "workers with different numbers of batches are not cut to the common number",
          "keras_boost/fit/data_sync.py",
          "    if known and len(set(steps)) == 1:",
          "    if known:",
          ("tests/test_never_hang.py::test_uneven_shards_end_together_with_identical_weights[gloo]",)),
    Break("evened_data_of_unknown_length", "evened-out arrays reach fit as a dataset of unknown length (no params['steps'])",
          "keras_boost/fit/data_sync.py",
          "    return dataset.take(steps).apply(tf.data.experimental.assert_cardinality(steps))",
          "    return dataset.take(steps)",
          ("tests/test_never_hang.py::test_uneven_shards_end_together_with_identical_weights[gloo]",)),
    Break("lessbn_warning_points_inside", "a level's LessBN warning points into keras_boost, not at the user's line",
          "keras_boost/model.py",
          "            _warnings.warn(caught_warning.message, caught_warning.category)",
          "            warnings.warn(caught_warning.message, caught_warning.category, stacklevel=1)",
          ("tests/test_less_bn.py::test_a_levels_lessbn_warning_points_at_the_users_boostmodel_call",)),
    Break("recompile_keeps_old_measurement", "compile keeps the previous step's self-measurement",
          "keras_boost/model.py",
          '        object.__setattr__(self, "_measuring", None)  # a new step: its stages are timed afresh',
          "        pass",
          ("tests/test_self_measurement.py::test_a_recompiled_model_measures_its_new_step",)),
    Break("lessbn_nested_hint_missing", "LessBN's warning does not name the nested model whose BatchNorms it cannot see",
          "keras_boost/graph/less_bn.py",
          "        if isinstance(layer, keras.Model):",
          "        if False:",
          ("tests/test_less_bn.py::test_a_warning_names_the_nested_model_whose_batchnorms_lessbn_cannot_see",)),
    Break("warmup_no_momentum_correction", "LearningRateWarmupCallback does not rescale SGD's momentum when the rate rises",
          "keras_boost/fit/callbacks.py",
          "            self._correct_momentum(self.factor(step) / self.factor(self._last_step))",
          "            pass",
          ("tests/test_horovod_callbacks.py::test_warmup_with_momentum_correction_equals_numpy",)),
    Break("warmup_rate_not_set", "LearningRateWarmupCallback leaves a float learning rate as it is",
          "keras_boost/fit/callbacks.py",
          "            self.model.optimizer.learning_rate = self.initial_lr * self.factor(step)",
          "            pass",
          ("tests/test_horovod_callbacks.py::test_warmup_with_momentum_correction_equals_numpy",
           "tests/test_horovod_callbacks.py::test_horovods_mnist_example_ported_to_keras_3_on_two_workers")),
    Break("metric_average_off", "MetricAverageCallback leaves each rank's own logs",
          "keras_boost/fit/callbacks.py",
          "                logs[name] = float(value.numpy())",
          "                pass",
          ("tests/test_horovod_callbacks.py::test_metric_average_callback_averages_a_plain_keras_models_logs",)),
    Break("freeze_gate_skips_unknown_length", "in a fit of unknown length the gate lets the groups compile unmeasured",
          "keras_boost/step/tuning.py",
          '        self._epoch_steps = self.params.get("steps") if self.params else None  # None: learnt at the first epoch\'s end',
          '        self._epoch_steps = self.params.get("steps") if self.params else None\n'
          '        if self._epoch_steps is None:\n            return',
          ("tests/test_self_measurement.py::test_in_a_fit_of_unknown_length_the_gate_holds_the_first_epoch",)),
    Break("freeze_gate_forgets_compilation", "a later gate takes a first step that compiled nothing as the compilation",
          "keras_boost/step/tuning.py",
          '        local = {"first": max(gate[0], self._first_step), "step": statistics.median(gate[1:])}',
          '        local = {"first": gate[0], "step": statistics.median(gate[1:])}',
          ("tests/test_self_measurement.py::test_a_fit_that_ends_inside_the_gate_leaves_the_next_fit_to_gate",)),
    Break("level_copies_user_layers", "a BoostModel at a boost level trains copies of the user's layers",
          "keras_boost/stages/less_bn.py",
          "share_layers=True, fn_outputs=",
          "share_layers=False, fn_outputs=",
          ("tests/test_less_bn.py::test_a_boost_level_trains_the_users_own_layers",)),
    Break("lessbn_removes_learnt_batchnorms", "LessBN removes BatchNorms that hold pretrained statistics or are frozen",
          "keras_boost/graph/less_bn.py",
          "        why = _holds_what_it_learnt(graph.layer(bn))",
          "        why = None",
          ("tests/test_less_bn.py::test_batchnorms_that_hold_what_they_learnt_are_kept",)),
    Break("level_flattens_outputs", "a BoostModel at a level turns the user's dict of outputs into a list",
          "keras_boost/model.py",
          "    inputs, outputs = _keras_compat.functional_structure(model)",
          "    inputs, outputs = model.inputs, model.outputs",
          ("tests/test_less_bn.py::test_a_level_keeps_the_users_output_structure_and_names",)),
    Break("level_renames_outputs", "an FN head's Activation renames the output its classifier produced",
          "keras_boost/stages/less_bn.py",
          "            keep_output_names(rewritten, model)",
          "            pass",
          ("tests/test_less_bn.py::test_list_outputs_with_losses_keyed_by_layer_name_at_a_level",)),
    Break("dense1_regression_is_a_classifier", "a level takes a Dense(1) regression output for a classifier",
          "keras_boost/graph/less_bn.py",
          "    if dense.units >= 2:\n        return True",
          "    if True:\n        return True",
          ("tests/test_less_bn.py::test_a_level_keeps_every_batchnorm_when_an_output_is_not_a_classifier",)),
    Break("lessbn_removes_before_a_regression", "a level removes BatchNorms although an output is not a classifier",
          "keras_boost/graph/less_bn.py",
          "    if others and removed_layers:",
          "    if False:",
          ("tests/test_less_bn.py::test_a_level_keeps_every_batchnorm_when_an_output_is_not_a_classifier",)),
    Break("false_does_not_switch_freezing_off", "compile(gradient_freeze=False) is refused at a level",
          "keras_boost/stages/freeze/stage.py",
          "        if value is None or value is False:\n            return None\n        if value is True:",
          "        if value is None:\n            return None\n        if value is True:",
          ("tests/test_auto_boost.py::test_false_switches_off_the_levels_stage_of_an_option[gradient_freeze-FreezeStage]",)),
    Break("fn_head_regression_loss_silent", "a regression loss on an FN head's output passes compile unsaid",
          "keras_boost/stages/less_bn.py",
          "            if _loss_name(given) in _REGRESSION_LOSSES:",
          "        if False:",
          ("tests/test_less_bn.py::test_a_regression_loss_on_an_fn_head_is_named_at_compile[mse]",)),
    Break("bn_statistics_not_averaged", "BatchNorm moving statistics stay each worker's own at the epoch's end",
          "keras_boost/fit/callbacks.py",
          "            for variable, value in zip(variables, averaged):\n                variable.assign(value)",
          "            pass",
          ("tests/test_horovod_callbacks.py::test_batchnorm_statistics_are_averaged_at_each_epochs_end",)),
    Break("bn_statistics_not_added_by_fit", "BoostModel.fit does not average BatchNorm statistics by itself",
          "keras_boost/model.py",
          "            callbacks.insert(0, AverageBatchNormStatistics())",
          "            pass",
          ("tests/test_horovod_callbacks.py::test_batchnorm_statistics_are_averaged_at_each_epochs_end",)),
    Break("fingerprint_ignored", "workers with different configurations are not refused at fit start",
          "keras_boost/fit/data_sync.py",
          "    if differences:\n        raise ValueError(",
          "    if False:\n        raise ValueError(",
          ("tests/test_never_hang.py::test_mismatched_workers_are_refused_before_any_collective",)),
    Break("gc_optimizer_off", "the GC optimizer wrapper passes the gradients through uncentred",
          "keras_boost/optimizers/centralization.py",
          "        self.inner_optimizer.apply(self.centralization.apply(list(grads), trainable_variables), "
          "trainable_variables)",
          "        self.inner_optimizer.apply(list(grads), trainable_variables)",
          ("tests/test_dropin.py::test_gc_optimizer_wrapper_on_a_plain_keras_model",
           "tests/test_mindspore_port.py::test_gc_optimizer_centres_only_the_selected_variables")),
    Break("boost_state_in_weights", "the boost state is tracked as a model weight again",
          "keras_boost/model.py",
          '        object.__setattr__(self, "boost_state", BoostState())',
          "        self.boost_state = BoostState()",
          ("tests/test_dropin.py::test_boost_state_is_not_a_model_weight",)),
    # many hosts from the command (issue 25): launch, preflight, run-time pitfalls
    Break("hosts_not_passed", "keras-boost train --hosts launches on localhost instead of the hosts",
          "keras_boost/app/launch.py",
          '"-H", hosts_argument(hosts) if hosts else f"localhost:{np_workers}"]',
          '"-H", f"localhost:{np_workers}"]',
          ("tests/test_cli_hosts.py::test_horovodrun_command_with_hosts_interface_and_start_timeout",)),
    Break("np_over_slots_allowed", "--np larger than the hosts' slots is not refused",
          "keras_boost/app/launch.py",
          "    if np_workers > slots:", "    if False:",
          ("tests/test_cli_hosts.py::test_bad_hostfile_and_too_many_workers",)),
    Break("preflight_no_loopback", "the preflight does not check hostnames that resolve to loopback",
          "keras_boost/app/preflight.py",
          '            loopback = [a for a in host.get("addresses", []) if is_loopback(a)]',
          "            loopback = []",
          ("tests/test_cli_hosts.py::test_loopback_hostname_is_a_problem_with_more_than_one_host",)),
    Break("preflight_versions_ignored", "the preflight does not compare the hosts' versions with the launcher's",
          "keras_boost/app/preflight.py",
          "        if theirs and mine and theirs != mine:", "        if False:",
          ("tests/test_cli_hosts.py::test_same_hostname_ssh_failure_missing_python_and_versions",)),
    Break("versions_not_in_fingerprint", "workers with different package versions are not refused at fit start",
          "keras_boost/fit/data_sync.py",
          '    return {"versions": package_versions(), "host": socket.gethostname(),',
          '    return {"host": socket.gethostname(),',
          ("tests/test_cli_hosts.py::test_different_package_versions_are_refused_at_fit_start_naming_them",)),
    Break("verbose_bar_on_terminal", "verbose='auto' draws a bar under a launcher whose stdout is a (pseudo-)terminal",
          "keras_boost/fit/dropin.py",
          '    if verbose == "auto" and distributed.launched():',
          '    if verbose == "auto" and distributed.launched() and not __import__("sys").stdout.isatty():',
          ("tests/test_cli_hosts.py::test_verbose_auto_is_one_line_per_epoch_under_any_launcher_even_on_a_terminal",)),
    Break("watchdog_no_heartbeat", "a waiting worker republishes its position only when it moves (no heartbeat)",
          "keras_boost/fit/watchdog.py",
          "        if store.available and (version != published or time.monotonic() - published_at >= beat):",
          "        if store.available and version != published:",
          ("tests/test_never_hang.py::test_a_stalled_worker_ends_the_job_within_the_timeout_naming_it",)),
    Break("lost_host_not_named", "the stall message does not name the rank and host it stopped hearing from",
          "keras_boost/fit/watchdog.py",
          '    silent = [r for r, e in table.items() if e is not None and r != rank and now - e["time"] > silent_after]',
          "    silent = []",
          ("tests/test_multihost.py::test_a_host_that_drops_off_ends_the_job_and_a_relaunch_resumes",)),
    Break("gloo_loopback_unchecked", "a worker whose hostname resolves to loopback under multi-host Gloo is not named",
          "keras_boost/distributed/hosts.py",
          "    if loopback is None or not loopback.is_loopback:", "    if True:",
          ("tests/test_cli_hosts.py::test_host_address_check_matches_what_gloo_does",)),
    Break("compression_not_saturating", "compression casts finite gradients beyond float16's range to inf",
          "keras_boost/stages/compression.py",
          "        saturated = tf.where(tf.math.is_finite(g), tf.clip_by_value(g, -bound, bound), g)",
          "        saturated = g",
          ("tests/test_compression.py::test_two_workers_compress_on_the_wire",)),
    Break("compression_saturates_at_max", "compression saturates at float16's max, which the wire's sum overflows",
          "keras_boost/stages/compression.py",
          "    bound = saturation_bound(dtype, workers)", "    bound = saturation_bound(dtype, 1)",
          ("tests/test_compression.py::test_two_workers_compress_on_the_wire",)),
    Break("compression_clips_nonfinite", "compression turns inf/nan into finite values (hiding an overflow)",
          "keras_boost/stages/compression.py",
          "        saturated = tf.where(tf.math.is_finite(g), tf.clip_by_value(g, -bound, bound), g)",
          "        saturated = tf.clip_by_value(tf.where(tf.math.is_nan(g), tf.zeros_like(g), g), -bound, bound)",
          ("tests/test_compression.py::test_compress_float16_matches_numpy_casting",)),
    Break("compression_decode_skipped", "the reduced gradients are not cast back to their dtype",
          "keras_boost/stages/compression.py",
          "        return decompress(grads, dtypes)", "        return grads",
          ("tests/test_compression.py::test_the_stage_casts_on_two_workers_and_does_nothing_on_one",)),
    Break("encode_decode_not_called", "the step reduces without the encode/decode hooks",
          "keras_boost/step/loop.py",
          "        grads = self._communicate(grads, indices, reducer.reduce, votes=self.stop_votes,\n"
          "                                  carries=reducer.carries_votes)\n",
          "        grads = reducer.reduce(grads, indices)\n",
          ("tests/test_compression.py::test_the_step_encodes_before_reduce_and_decodes_after_once_per_update",)),
    Break("each_waits_for_backward", 'gradient_split_groups="each" groups every gradient into one allreduce, '
          "which waits for the whole backward pass (no overlap of communication with it)",
          "keras_boost/stages/average.py",
          "            return distributed.allreduce_each(grads)",
          "            return distributed.grouped_allreduce(grads)",
          ("tests/test_multiprocess.py::test_two_workers_equal_one_process_with_twice_the_batch[gloo]",)),
    Break("clipping_off", "the built-in gradient clipping stage passes the gradients through unclipped",
          "keras_boost/stages/clipping.py",
          "        return tf.clip_by_global_norm(grads, limit)[0]", "        return grads",
          ("tests/test_stage_contract.py::test_builtin_gradient_clipping_matches_keras_global_clipnorm",)),
    Break("measured_verdict_ignored", "self-measurement decides but never switches a stage that does not pay off",
          "keras_boost/step/tuning.py",
          "            if not pays:\n                stage.switch_off()\n",
          "            if not pays:\n                pass\n",
          ("tests/test_self_measurement.py::test_switched_off_freezing_trains_the_full_step_and_holds_its_position",
           "tests/test_self_measurement.py::test_two_workers_switch_off_together")),
    Break("freeze_switch_ignored", "a switched-off freeze stage goes on advancing its sequence inside the step",
          "keras_boost/stages/freeze/stage.py",
          "            following = tf.where(self.active(), following, self.position.value)\n",
          "            following = following\n",
          ("tests/test_self_measurement.py::test_switched_off_freezing_trains_the_full_step_and_holds_its_position",)),
    Break("optimizer_loss_scale_ignored", "the boost step does not scale the loss by the optimizer's own scale "
          "(Keras' LossScaleOptimizer, loss_scale_factor), which its apply divides out",
          "keras_boost/step/loop.py",
          "            target = self.optimizer.scale_loss(target)\n",
          "",
          ("tests/test_keras_parity.py::test_keras_loss_scale_optimizer_trains_as_in_keras_model",
           "tests/test_keras_parity.py::test_boost_model_matches_keras_model[loss_scale_factor]")),
    Break("two_loss_scales", "a compile loss_scale beside a Keras LossScaleOptimizer is accepted (two scales of one loss)",
          "keras_boost/stages/loss_scale.py",
          "        if keras_loss_scale_optimizer(optimizer) is not None:\n            raise ValueError(",
          "        if False:\n            raise ValueError(",
          ("tests/test_loss_scale.py::test_a_keras_loss_scale_optimizer_is_the_loss_scale",)),
    Break("clip_ignores_optimizer_scale", "gradient clipping clips gradients a LossScaleOptimizer has not unscaled yet",
          "keras_boost/stages/clipping.py",
          "self._optimizer.scale_loss(self.clip_norm)",
          "self.clip_norm",
          ("tests/test_loss_scale.py::test_gradient_clipping_clips_the_gradients_a_loss_scale_optimizer_unscales",)),
    Break("gc_static_gradient_shape", "gradient centralization reads the gradient's static shape, not its variable's",
          "keras_boost/stages/centralization.py",
          "    if grad.shape.is_fully_defined() or shape is None:\n        return grad\n",
          "    return grad\n",
          ("tests/test_centralization.py::test_a_gradient_traced_without_its_batch_dimension_is_centralized",)),
    Break("freeze_without_less_bn", "a level's freezing stays on where LessBN removed no BatchNorm",
          "keras_boost/stages/freeze/stage.py",
          "        if self.switch is not None and self.is_on() and not removed:",
          "        if False:",
          ("tests/test_self_measurement.py::"
           "test_without_a_removed_batchnorm_the_level_adds_no_fn_head_no_centralization_and_no_freezing",)),
    Break("launcher_not_ended", "keras-boost waits for a launcher that stays in its abort after a worker ended the job",
          "keras_boost/app/launch.py",
          "            if \"at\" in ending and time.monotonic() - ending[\"at\"] > ending.get(\"grace\", grace):",
          "            if False:",
          ("tests/test_cli.py::test_a_launcher_still_waiting_after_a_worker_ended_the_job_is_ended",)),
    Break("logger_on_every_worker", "a CSVLogger or TensorBoard path that every worker gives is written by every worker",
          "keras_boost/fit/dropin.py",
          "            if rank != ranks[0]:\n                callbacks[index] = keras.callbacks.Callback()",
          "            pass",
          ("tests/test_dropin.py::test_a_path_several_workers_log_to_is_written_by_one_and_keras_backup_becomes_the_jobs",
           "tests/test_dropin_multiprocess.py::"
           "test_a_script_written_for_one_machine_writes_each_file_once_and_whole_on_two_workers")),
    Break("save_not_whole", "on several workers save and save_weights write the target itself, all at once",
          "keras_boost/fit/dropin.py",
          "    if distributed.size() <= 1 or suffix is None or \"://\" in path:",
          "    if True:",
          ("tests/test_dropin_multiprocess.py::"
           "test_a_script_written_for_one_machine_writes_each_file_once_and_whole_on_two_workers",)),
    Break("keras_backup_kept", "Keras' own BackupAndRestore given on every worker stays Keras' (every worker writes it)",
          "keras_boost/fit/dropin.py",
          "            if len(ranks) == size and type(callback) is keras.callbacks.BackupAndRestore:",
          "            if False:",
          ("tests/test_dropin.py::test_a_path_several_workers_log_to_is_written_by_one_and_keras_backup_becomes_the_jobs",
           "tests/test_multihost.py::test_a_backup_on_the_first_hosts_disk_alone_resumes_every_host")),
    Break("backup_not_sent", "rank 0 restores the backup but does not send it to the other workers",
          "keras_boost/fit/callbacks.py",
          "        found = distributed.broadcast_object(found, root_rank=0)\n        if not found[0]:",
          "        if True:",
          ("tests/test_multihost.py::test_a_backup_on_the_first_hosts_disk_alone_resumes_every_host",)),
    Break("same_data_unsaid", "every worker given the same training arrays, and nothing is said",
          "keras_boost/fit/data_sync.py",
          "    if len(samples) < 2 or samples[0] is None or any(s != samples[0] for s in samples):",
          "    if True:",
          ("tests/test_data_sync.py::test_the_same_data_line_needs_every_worker_alike",
           "tests/test_dropin_multiprocess.py::test_rank_zero_says_when_every_worker_was_given_the_same_arrays")),
    Break("centralization_switch_ignored", "a switched-off centralization stage goes on centring the gradients",
          "keras_boost/stages/centralization.py",
          "        return tf.cond(self.active(), lambda: self.apply(grads, variables, sums), lambda: list(grads))",
          "        return self.apply(grads, variables, sums)",
          ("tests/test_self_measurement.py::test_switched_off_centralization_passes_gradients_through_without_a_retrace",)),
    Break("epoch_stall_back", "arrays reach Keras' fit with tf.data's autotuning on again (a stall at every epoch start)",
          "keras_boost/_keras_compat.py",
          "    options.autotune.enabled = False\n",
          "    options.autotune.enabled = True\n",
          ("tests/test_data_sync.py::test_arrays_reach_keras_as_its_own_dataset_without_autotuning",)),
    Break("stage_imports_the_loop", "a stage imports the step above it (a layer run back up)",
          "keras_boost/stages/average.py",
          "from keras_boost.core.contract import Stage\n",
          "from keras_boost.core.contract import Stage\nfrom keras_boost.step import registry  # noqa: F401\n",
          ("tests/test_layout.py::test_every_import_runs_down_the_layers",)),
    Break("default_reduce_not_made", "the registry does not add the default averaging stage",
          "keras_boost/step/registry.py",
          "        if not any(stage.overrides(cls.default_for) for stage in stages):",
          "        if cls.default_for != \"reduce\" and not any(stage.overrides(cls.default_for) for stage in stages):",
          ("tests/test_multiprocess.py::test_two_workers_equal_one_process_with_twice_the_batch[gloo]",)),
    Break("bfloat16_sum_not_averaged", "the bfloat16 allreduce returns the workers' sum, not their mean",
          "keras_boost/distributed/collectives.py",
          "            total = total / tf.cast(tf.shape(values)[0], tf.float64)", "            total = total",
          ("tests/test_compression.py::test_two_workers_compress_on_the_wire",)),
    Break("hierarchical_no_cross_allreduce", "the hierarchical allreduce never sums across hosts",
          "keras_boost/stages/hierarchical.py",
          '        shard = distributed.allreduce(shard, average=False, process_set=plan["across"])  # everyone\'s sum',
          "        shard = shard  # this host's sum only",
          ("tests/test_communication.py::test_hierarchical_allreduce_on_two_hosts_of_two_workers",)),
    Break("fusion_threshold_in_mb", "fusion_threshold_mb is passed to Horovod as MiB, not bytes",
          "keras_boost/distributed/runtime.py",
          '        env["HOROVOD_FUSION_THRESHOLD"] = str(int(round(fusion_threshold_mb * _MIB)))',
          '        env["HOROVOD_FUSION_THRESHOLD"] = str(int(round(fusion_threshold_mb)))',
          ("tests/test_communication.py::test_options_become_horovods_variables",)),
    Break("dynamic_process_sets_always_on", "Horovod starts with dynamic process sets whether a stage needs them or not",
          "keras_boost/distributed/runtime.py",
          "    return bool(_state.process_sets_wanted)\n",
          "    return True\n",
          ("tests/test_communication.py::test_horovod_starts_without_dynamic_process_sets_unless_a_stage_needs_them",)),
    Break("process_sets_wish_forgotten", "a stage made before Horovod starts does not switch dynamic process sets on",
          "keras_boost/distributed/runtime.py",
          "            _state.process_sets_wanted.append(what)\n",
          "            pass\n",
          ("tests/test_communication.py::test_a_stage_made_before_horovod_starts_switches_dynamic_process_sets_on",)),
    Break("communication_options_not_applied", "init's fusion/cycle/autotune options never reach Horovod",
          "keras_boost/distributed/runtime.py",
          "        os.environ.update(settings)  # before hvd.init(), which reads them",
          "        pass",
          ("tests/test_communication.py::test_init_sets_the_variables_before_horovod_starts",)),
    Break("groups_not_traced_ahead", "the freeze groups' steps are traced only when each group first trains",
          "keras_boost/step/dispatch.py",
          "        ahead = [b for b in self.model.boost_step.branches_ahead() if b not in self._traced]\n",
          "        ahead = []\n",
          ("tests/test_freeze_step.py::test_the_groups_ahead_are_traced_in_the_background_in_the_order_they_come",)),
    Break("model_call_unlocked", "a call of the model from the main thread runs while the background thread traces it",
          "keras_boost/model.py",
          "        with KERAS_LOCK:\n            return super().__call__(*args, **kwargs)\n",
          "        if True:\n            return super().__call__(*args, **kwargs)\n",
          ("tests/test_freeze_step.py::test_the_model_waits_for_a_trace_of_the_background_thread",)),
    Break("thread_settings_not_adopted", "the groups traced ahead see Keras' default dtype policy and no seed",
          "keras_boost/step/dispatch.py",
          "        _keras_compat.adopt_thread_settings(settings)\n",
          "        pass\n",
          ("tests/test_freeze_step.py::test_the_background_thread_traces_with_fits_dtype_policy_and_seed",)),
    Break("groups_not_set_up_ahead", "the groups traced ahead are not run on an empty iterator: their first step sets them up",
          "keras_boost/step/dispatch.py",
          "                self._set_up(branch, spec, element_spec)\n",
          "                pass\n",
          ("tests/test_freeze_step.py::test_the_groups_ahead_are_traced_in_the_background_in_the_order_they_come",)),
    Break("trace_numbering_shared_by_threads", "two threads tracing at once number their collectives from one counter",
          "keras_boost/distributed/runtime.py",
          "class _Tracing(threading.local):\n",
          "class _Tracing:\n",
          ("tests/test_distributed.py::test_collective_names_count_per_trace_whatever_another_thread_traces",
           "tests/test_distributed.py::test_the_boost_step_scope_is_per_thread")),
    Break("fused_update_not_entered", "the step never enters the fused update's kernels (Keras' update runs)",
          "keras_boost/stages/fused_update.py",
          "        return fused_kernels(optimizer)\n",
          "        return contextlib.nullcontext()\n",
          ("tests/test_fused_update.py::test_the_step_updates_with_one_kernel_per_variable",)),
    Break("fused_batchnorm_not_entered", "the step never enters the fused BatchNorm (Keras' ops run)",
          "keras_boost/stages/fused_batchnorm.py",
          "        return fused_calls(self.layers)\n",
          "        return fused_calls([])\n",
          ("tests/test_fused_batchnorm.py::test_the_step_trains_each_batchnorm_with_one_kernel",)),
    Break("fused_batchnorm_unbiased_moving_variance", "the moving variance averages the kernel's unbiased variance",
          "keras_boost/stages/fused_batchnorm.py",
          "    variance = unbiased * tf.where(n > 1.0, (n - 1.0) / tf.maximum(n, 1.0), 1.0)\n",
          "    variance = unbiased\n",
          ("tests/test_fused_batchnorm.py::test_fused_call_against_numpy",
           "tests/test_fused_batchnorm.py::test_fused_call_gives_keras_batchnorm")),
    Break("layer_swap_left", "the layers keep the swapped call after the step's forward pass (fused BatchNorm, "
          "one-pixel products)",
          "keras_boost/stages/swap.py",
          "                    object.__delattr__(layer, name)\n",
          "                    pass\n",
          ("tests/test_fused_batchnorm.py::test_swap_is_reentrant_thread_safe_and_undone_on_errors",
           "tests/test_conv_matmul.py::test_swap_is_reentrant_thread_safe_and_undone_on_errors")),
    Break("conv_matmul_not_entered", "the step never enters the one-pixel matrix products (Keras' convolutions run)",
          "keras_boost/stages/conv_matmul.py",
          "        return matmul_calls(self.layers, self.rewritten)\n",
          "        return matmul_calls([], self.rewritten)\n",
          ("tests/test_conv_matmul.py::test_the_step_runs_one_pixel_convolutions_as_matrix_products",)),
    Break("conv_matmul_padding_split", "\"same\" padding puts the larger half before (the wrong taps meet the input)",
          "keras_boost/stages/conv_matmul.py",
          "            before = max((out - 1) * s + span - n, 0) // 2\n",
          "            before = (max((out - 1) * s + span - n, 0) + 1) // 2\n",
          ("tests/test_conv_matmul.py::test_the_taps_of_a_one_pixel_output_against_numpy",
           "tests/test_conv_matmul.py::test_the_matrix_product_gives_keras_convolution")),
    Break("conv_matmul_depthwise_order", "a depthwise product orders its outputs multiplier-major, not channel-major",
          "keras_boost/stages/conv_matmul.py",
          "        y = tf.einsum(\"ntc,tcm->ncm\", pixels, weights)\n",
          "        y = tf.einsum(\"ntc,tcm->nmc\", pixels, weights)\n",
          ("tests/test_conv_matmul.py::test_the_matrix_product_gives_keras_convolution",)),
    Break("centralization_sums_not_shared", "the finite check sums the centralised gradients again",
          "keras_boost/step/loop.py",
          "            sums = summing[0].column_sums(grads, variables) if summing else None\n",
          "            sums = None\n",
          ("tests/test_centralization.py::test_the_finite_check_adds_the_centralization_sums_instead_of_reading_the_"
           "gradients_again",)),
    Break("finite_check_drops_summed_gradients", "the finite check leaves out the gradients a stage summed",
          "keras_boost/core/contract.py",
          "    wide = [g if s is None else s for g, s in pairs if g.dtype in (tf.float32, tf.float64)]\n",
          "    wide = [g for g, s in pairs if s is None and g.dtype in (tf.float32, tf.float64)]\n",
          ("tests/test_centralization.py::test_finite_check_with_column_sums_sees_every_non_finite_value",
           "tests/test_centralization.py::test_nan_guard_with_centralization_stops_before_the_weights_are_touched")),
    Break("sparse_sums_of_unique_rows", "GC sums a sparse gradient's repeated rows once",
          "keras_boost/stages/centralization.py",
          "        return tf.reduce_sum(tf.reshape(values, [-1, values.shape[-1]]), axis=0, keepdims=True)\n",
          "        return tf.reduce_sum(tf.gather(tf.reshape(values, [-1, values.shape[-1]]),\n"
          "                                       tf.unique(grad.indices)[1][:1]), axis=0, keepdims=True)\n",
          ("tests/test_sparse_gradients.py::test_column_sums_and_centralize_of_a_sparse_gradient_match_numpy",
           "tests/test_sparse_gradients.py::test_gc_all_centralizes_an_embedding_table_like_the_keras_io_recipe")),
    Break("sparse_gradients_made_dense", "the finite check and the loss scale make an Embedding's gradient dense",
          "keras_boost/core/contract.py",
          "    if isinstance(grad, tf.IndexedSlices):\n        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)\n",
          "    grad = tf.convert_to_tensor(grad)\n",
          ("tests/test_sparse_gradients.py::test_loss_scale_unscales_a_sparse_gradient_and_keeps_it_sparse",)),
    Break("stop_not_agreed", "each worker stops when its own callbacks ask, without the others",
          "keras_boost/fit/callbacks.py",
          "        votes = distributed.allreduce(tf.constant(1.0 if self._requested else 0.0, tf.float32))\n",
          "        votes = tf.constant(1.0 if self._requested else 0.0, tf.float32)\n",
          ("tests/test_multiprocess.py::test_a_callback_that_stops_one_worker_stops_every_worker_after_the_same_batch",)),
    Break("stop_vote_not_carried", "the workers' stop votes are reduced but never reach the callback",
          "keras_boost/step/votes.py",
          "    votes.agreed.assign(tf.cast(agreed, tf.float32))\n",
          "    votes.agreed.assign(tf.zeros_like(tf.cast(agreed, tf.float32)))\n",
          ("tests/test_multiprocess.py::test_a_callback_that_stops_one_worker_stops_every_worker_after_the_same_batch",)),
    Break("stop_vote_own_collective", "the stop vote takes a collective of its own beside the gradients'",
          "keras_boost/stages/average.py",
          "    carries_votes = True",
          "    carries_votes = False",
          ("tests/test_multiprocess.py::test_a_callback_that_stops_one_worker_stops_every_worker_after_the_same_batch",)),
    Break("update_runs_ahead_of_data", "the update's data-independent ops (iterations += 1) run on the call that ends "
          "an epoch of unknown length",
          "keras_boost/step/loop.py",
          "        with tf.control_dependencies([loss]):\n",
          "        with contextlib.nullcontext():\n",
          ("tests/test_model.py::test_an_epoch_of_unknown_length_counts_only_the_updates_it_applied",)),
    Break("step_copies_gradients", "the step copies every gradient before the update (keras.Model's step has no copy)",
          "keras_boost/step/loop.py",
          "        if in_cond:\n            # Keras' TF optimizer",
          "        if True:\n            # Keras' TF optimizer",
          ("tests/test_keras_parity.py::test_boost_model_step_runs_keras_models_ops",)),
    Break("stop_mid_epoch_in_one_process", "one process defers a callback's stop to the epoch's end",
          "keras_boost/model.py",
          "        return together.decision() if together is not None else self.__dict__.get(\"_stop_training\", False)\n",
          "        return together.decision() if together is not None else False\n",
          ("tests/test_keras_parity.py::test_boost_model_matches_keras_model[stop_training_mid_epoch]",)),
    Break("fused_nesterov_ignored", "the momentum kernel ignores Nesterov",
          "keras_boost/stages/fused_update.py",
          "use_nesterov=bool(optimizer.nesterov))",
          "use_nesterov=False)",
          ("tests/test_fused_update.py::test_kernels_give_keras_update",)),
    Break("fused_adam_step_count_off", "Adam's kernel takes beta^t one step late (t = iterations, not iterations + 1)",
          "keras_boost/stages/fused_update.py",
          "local_step = tf.cast(optimizer.iterations + 1, dtype)",
          "local_step = tf.cast(optimizer.iterations, dtype)",
          ("tests/test_fused_update.py::test_kernels_give_keras_update",)),
    Break("auto_bf16_without_onednn", "precision auto picks bfloat16 on an AVX512-BF16 CPU with oneDNN off (emulated)",
          "keras_boost/precision.py",
          "cpu_bf16 = not capabilities and cpu_has_native_bf16() and onednn_enabled()",
          "cpu_bf16 = not capabilities and cpu_has_native_bf16()",
          ("tests/test_gpu.py::test_auto_precision_on_cpus_needs_onednn",
           "tests/test_gpu.py::test_auto_precision_on_a_cpu_with_and_without_native_bf16_and_onednn")),
    Break("freeze_gate_never_closes", "the gate before the freeze groups compile lets freezing on in any fit",
          "keras_boost/stages/freeze/stage.py",
          "        return saving >= compiling, (",
          "        return True, (",
          ("tests/test_self_measurement.py::test_the_gate_switches_freezing_off_before_a_group_compiles_in_a_short_fit",)),
    Break("freeze_gate_held_forever", "the gate holds freezing back and never lets it on again",
          "keras_boost/step/tuning.py",
          "            selecting.switch.assign(True)\n            return",
          "            return",
          ("tests/test_self_measurement.py::test_a_fit_long_enough_passes_the_gate_and_freezes_from_there",)),
    Break("freeze_gate_mid_window", "the gate changes freezing's group inside a gradient accumulation window",
          "keras_boost/step/tuning.py",
          "if len(self._gate) >= self.gate_steps and self._epoch_steps is not None and self._at_boundary():",
          "if len(self._gate) >= self.gate_steps and self._epoch_steps is not None:",
          ("tests/test_self_measurement.py::test_with_accumulation_the_gate_changes_freezing_only_between_windows",)),
    Break("tensorflow_range_unchecked", "import keras_boost accepts any TensorFlow version",
          "keras_boost/_startup.py",
          "    problem = tensorflow_problem(tf.__version__)",
          "    problem = None",
          ("tests/test_versions.py::test_import_refuses_a_tensorflow_outside_the_range",)),
    Break("startup_lines_unfiltered", "TensorFlow's abseil start-up lines pass whatever the level",
          "keras_boost/_startup.py",
          "        self._dropped_notice = bool(match) and _SEVERITY[match.group(1)] < self.level",
          "        self._dropped_notice = False",
          ("tests/test_versions.py::test_the_filter_drops_exactly_the_abseil_lines_below_the_level",)),
    Break("setup_patch_id_differs", "setup.sh names the wheel cache by another patch-set id than build-horovod",
          "scripts/setup.sh",
          "| sha256sum | cut -c1-8)",
          "| sha256sum | cut -c1-7)",
          ("tests/test_setup_plan.py::test_setup_computes_the_patch_set_id_as_build_horovod_does",
           "tests/test_setup_plan.py::test_cpu_machine_plans_tensorflow_cpu_and_the_patched_horovod_wheel")),
    Break("fused_batchnorm_under_xla", "a step compiled by XLA trains BatchNorm through XLA's one-pass FusedBatchNormV3",
          "keras_boost/stages/fused_batchnorm.py",
          "        if model.jit_compile:",
          "        if False:",
          ("tests/test_fused_batchnorm.py::test_a_step_compiled_by_xla_keeps_keras_batchnorm_and_its_exact_moving_variance",)),
    Break("evaluate_always_across_workers", "evaluate() called by a script sums the metrics of every worker",
          "keras_boost/model.py",
          "        if across_workers is None:\n            across_workers = in_fit",
          "        if across_workers is None:\n            across_workers = True",
          ("tests/test_idioms.py::test_idioms_on_one_host[gloo]",), 420),
    Break("rendezvous_never_compares", "workers at different calls that need every worker are not told",
          "keras_boost/distributed/collectives.py",
          "    if len(set(calls)) > 1:",
          "    if False:",
          ("tests/test_idioms.py::test_idioms_on_one_host[gloo]",), 420),
    Break("progress_bar_under_launcher", "verbose=1 into a pipe or under a launcher redraws Keras' bar",
          "keras_boost/fit/dropin.py",
          "    if verbose in (1, True) and (distributed.launched() or not _writes_to_a_terminal()):",
          "    if False:",
          ("tests/test_progress_lines.py::test_fit_with_verbose_1_into_a_pipe_prints_whole_lines",)),
    Break("progress_lines_unbounded", "progress lines as long as their metrics make them",
          "keras_boost/fit/dropin.py",
          "        while len(line) > self.width and parts:",
          "        while False:",
          ("tests/test_progress_lines.py::test_no_line_is_longer_than_the_width",)),
    Break("lost_rank_not_named", "a worker whose fit was abandoned does not name the rank it stopped hearing from",
          "keras_boost/fit/watchdog.py",
          "              if r != rank and (entry is None or now - entry[\"time\"] > 2 * beat + ProgressStore.TIMEOUT)]",
          "              if False]",
          ("tests/test_multihost.py::test_a_host_that_drops_off_ends_the_job_and_a_relaunch_resumes[600]",), 420),
    Break("launcher_summary_dropped", "a failed job does not end with the lost ranks and the command to relaunch",
          "keras_boost/app/launch.py",
          "        summary = [f\"keras-boost: the job ended with status {status}.\"] + named",
          "        summary = []",
          ("tests/test_cli.py::test_a_failed_job_ends_with_the_lost_ranks_and_the_command_to_relaunch",)),
    Break("config_checked_after_launch", "a bad --config file is found only by the launched workers",
          "keras_boost/app/cli.py",
          "    _check_config(parser, args)\n",
          "",
          ("tests/test_cli.py::test_a_bad_config_file_is_a_usage_error_before_anything_is_launched",)),
    Break("warning_at_keras_line", "keras_boost's warnings name keras_boost's own line, not the user's",
          "keras_boost/_warnings.py",
          "    while frame is not None and _internal(frame.f_code.co_filename):",
          "    while False:",
          ("tests/test_warnings.py",)),
    Break("option_error_another_name", "a bad compile option's error names the stage's argument, not the option",
          "keras_boost/stages/accumulation.py",
          "            if value < 1:\n                raise cls.bad_option(value, ValueError)\n",
          "",
          ("tests/test_bad_input_sweep.py::test_every_compile_option_refuses_a_bad_value_in_one_style",)),
    Break("slurm_hosts_ignored", "keras-boost train inside a Slurm allocation runs one process",
          "keras_boost/app/cli.py",
          "    hosts = launch.slurm_hosts()\n",
          "    hosts = None\n",
          ("tests/test_slurm.py::test_mpirun_and_keras_boost_train_inside_an_allocation",), 600),
    Break("cluster_run_in_root_folder", "cluster.sh run starts the command in / instead of the caller's folder",
          "tests/cluster.py",
          "    proc = cluster.popen(args.host, argv or [\"bash\"], cwd=os.getcwd())",
          "    proc = cluster.popen(args.host, argv or [\"bash\"])",
          ("tests/test_readme_commands.py::test_the_readme_many_hosts_commands",), 600),
    Break("loss_scale_outside_state", "the loss scale kept in a plain keras.Variable outside the boost state",
          "keras_boost/stages/loss_scale.py",
          "        self.scale = state.add_state(\"loss_scale/scale\", self.init_scale, \"float32\")\n        self.clean_steps",
          "        self.scale = keras.Variable(self.init_scale, dtype=\"float32\", trainable=False, name=\"outside\")\n"
          "        self.clean_steps",
          ("tests/test_resume.py::test_backup_and_restore_resumes_bit_identically",)),
    Break("no_progress_store_under_mpi", "under MPI rank 0 serves no store for the workers' positions",
          "keras_boost/distributed/progress_store.py",
          "    if size < 2 or os.environ.get(\"HOROVOD_GLOO_RENDEZVOUS_ADDR\") or \"address\" in _served:",
          "    if True:",
          ("tests/test_multihost.py::test_a_host_that_drops_off_under_mpi_is_named_by_the_workers_and_the_launcher",),
          420),
    Break("launcher_waits_on_a_named_lost_host", "the launcher waits its full grace after a worker named a lost host",
          "keras_boost/app/launch.py",
          "                ending[\"grace\"] = min(grace, NAMED_GRACE)",
          "                pass",
          ("tests/test_multihost.py::test_a_host_that_drops_off_under_mpi_is_named_by_the_workers_and_the_launcher",),
          420),
    Break("set_up_after_run", "trace-ahead sets up (an empty call) a group that fit's thread already ran",
          "keras_boost/step/dispatch.py",
          "            if branch in self._ran or branch not in self._traced:",
          "            if branch not in self._traced:",
          ("tests/test_freeze_step.py::test_a_group_that_fits_thread_reached_first_is_not_set_up_again",)),
    Break("freeze_opt_zero_gradients", "FreezeOpt feeds zero gradients to the frozen variables (their momentum moves)",
          "keras_boost/stages/freeze/optimizer.py",
          "            chosen = [(g, v) for g, v in pairs if id(v) in allowed]\n\n            def run():",
          "            chosen = [(g if id(v) in allowed else tf.zeros_like(g), v) for g, v in pairs]\n\n"
          "            def run():",
          ("tests/test_freeze_sequence.py::"
           "test_freeze_opt_leaves_the_frozen_variables_and_their_momentum_untouched[keras.Model]",)),
    Break("boost_scalars_in_the_bar", "the progress bar shows the boost scalars the stages declare",
          "keras_boost/fit/dropin.py",
          "    hidden = set(step.log_keys()) if step is not None else set()",
          "    hidden = set()",
          ("tests/test_dropin.py::test_boost_scalars_stay_out_of_the_bar_but_in_the_history",)),
    Break("stage_fit_callbacks_dropped", "fit does not add the callbacks the stages ask for (the NaN guard's stop)",
          "keras_boost/model.py",
          "            callbacks[:0] = [c for stage in self.boost_step.stages for c in stage.fit_callbacks()]",
          "            pass",
          ("tests/test_model.py::test_nan_guard_stops_before_the_weights_are_touched",)),
    Break("rewrite_compile_check_dropped", "compile does not ask the model rewrites about the loss (FN head + regression)",
          "keras_boost/model.py",
          "            rewrite.check_compile(self, loss)",
          "            pass",
          ("tests/test_less_bn.py::test_a_regression_loss_on_an_fn_head_is_named_at_compile[mse]",)),
    Break("rewrite_report_dropped", "the train report leaves out what the model rewrites did",
          "keras_boost/app/training.py",
          "        report.update(rewrite.report(model))",
          "        pass",
          ("tests/test_cli.py::test_train_single_process_with_level_and_checkpoint",)),
    Break("swa_running_mean_wrong", "SWA's running average weighs the newest weights wrong",
          "keras_boost/stages/swa.py",
          "(variable - average) / (n + 1.0)",
          "(variable - average) / (n + 2.0)",
          ("tests/test_swa.py::test_the_weights_end_as_the_mean_of_the_epoch_ends_from_the_start_on[0.5-averaged0]",)),
    Break("swa_weights_not_replaced", "after fit the model keeps its last weights, not the average",
          "keras_boost/stages/swa.py",
          "            variable.assign(average)",
          "            pass",
          ("tests/test_swa.py::test_the_weights_end_as_the_mean_of_the_epoch_ends_from_the_start_on[0.5-averaged0]",)),
    Break("swa_start_off_by_one", "SWA starts one epoch after its start",
          "keras_boost/stages/swa.py",
          "if epoch >= self.start and",
          "if epoch > self.start and",
          ("tests/test_swa.py::test_the_weights_end_as_the_mean_of_the_epoch_ends_from_the_start_on[0.5-averaged0]",)),
    Break("after_fit_not_called", "BoostModel.fit does not run the stages' after-fit work",
          "keras_boost/model.py",
          "                stage.after_fit(self, lambda: _keras_compat.training_batches(kwargs))",
          "                pass",
          ("tests/test_swa.py::test_the_weights_end_as_the_mean_of_the_epoch_ends_from_the_start_on[0.5-averaged0]",)),
    Break("swa_batchnorm_keeps_momentum", "the BatchNorm pass leaves the layers' momentum, so the statistics stay mostly the trajectory's",
          "keras_boost/stages/swa.py",
          "            layer.momentum = 0.0",
          "            pass",
          ("tests/test_swa.py::test_batchnorm_statistics_are_the_mean_batch_statistics_of_the_averaged_weights",)),
    Break("swa_batchnorm_not_averaged_across_workers", "each worker keeps the BatchNorm statistics of its own data after SWA",
          "keras_boost/stages/swa.py",
          "        *sums, count = distributed.grouped_allreduce([*sums, count], average=False)",
          "        pass",
          ("tests/test_swa.py::test_on_two_workers_every_rank_ends_with_the_same_average_and_statistics_of_all_data",)),
    Break("swa_count_outside_boost_state", "SWA's count kept in a plain variable: a resumed run restarts the average",
          "keras_boost/stages/swa.py",
          'self.count = context.state.add_state("swa/count", 0, "int64")',
          "self.count = tf.Variable(0, dtype=tf.int64)",
          ("tests/test_resume.py::test_backup_and_restore_resumes_bit_identically",)),
    Break("tta_target_below_the_reference", "time to accuracy measured to 0.5 pp below the reference's accuracy, not to it",
          "keras_boost/app/bench.py",
          "    target = final[levels[0]]\n",
          "    target = final[levels[0]] - NEAR\n",
          ("tests/test_cli.py::test_bench_summary_takes_medians_over_runs_and_the_target_from_the_first_level",)),
    Break("tta_curve_of_one_run", "a level's time to accuracy read from its first run, not from the mean over its runs",
          "keras_boost/app/bench.py",
          '        if statistics.fmean(r["accuracies"][epoch] for r in runs) >= target - 1e-6:',
          '        if runs[0]["accuracies"][epoch] >= target - 1e-6:',
          ("tests/test_cli.py::test_time_to_target_is_read_from_the_mean_curve_of_the_runs",)),
    Break("bench_level_precision_ignored", "keras-boost bench runs O1:float32 in the --precision choice",
          "keras_boost/app/bench.py",
          "    level_args.precision = precision or args.precision",
          "    level_args.precision = args.precision",
          ("tests/test_cli.py::test_bench_writes_table_and_plot",)),
    Break("recipe_tokens_not_pooled", "the transformer recipe's tokens are the patches' brightest pixel, not their mean",
          "keras_boost/app/recipes.py",
          "    pooled = images.reshape(len(images), 14, 2, 14, 2).mean(axis=(2, 4))",
          "    pooled = images.reshape(len(images), 14, 2, 14, 2).max(axis=(2, 4))",
          ("tests/test_accuracy_rules.py::test_recipe_inputs_keep_every_image",)),
    Break("freeze_off_keeps_its_branches", "freezing switched off as the step is built still runs the per-group train function",
          "keras_boost/stages/freeze/stage.py",
          "            return None\n        return self.group_indices, self.current_group",
          "            pass\n        return self.group_indices, self.current_group",
          ("tests/test_self_measurement.py::test_without_a_removed_batchnorm_the_level_adds_no_fn_head_no_centralization_and_no_freezing",)),
    Break("cli_flag_dropped", "keras-boost train parses --accumulation but trains without it",
          "keras_boost/stages/accumulation.py",
          '        return args.accumulation if getattr(args, "accumulation", 1) > 1 else None',
          "        return None",
          ("tests/test_cli.py::test_each_stages_flags_become_its_compile_option",)),
    Break("cli_window_not_counted", "a config's freezing is sized to batches, not to the accumulation's updates",
          "keras_boost/stages/accumulation.py",
          '        return getattr(value, "max_accumulation_step", value) or 1',
          "        return 1",
          ("tests/test_cli.py::test_each_stages_flags_become_its_compile_option",)),
    Break("native_adasum_on_gloo", "Horovod's native Adasum thought available without MPI",
          "keras_boost/stages/adasum_ops.py",
          '    return bool(distributed.launch_facts()["mpi"] and groups >= 1',
          "    return bool(groups >= 1",
          ("tests/test_distributed.py::test_capabilities_report_the_build",)),
)


def by_name():
    return {b.name: b for b in BREAKS}


def check_snippet(brk, root=ROOT):
    """The source of `brk.path` under `root`; raises when the snippet is not there exactly once."""
    path = root / brk.path
    if not path.exists():
        raise SystemExit(f"mutation {brk.name!r}: {brk.path} does not exist (the code moved); update BREAKS")
    source = path.read_text()
    count = source.count(brk.snippet)
    if count != 1:
        raise SystemExit(f"mutation {brk.name!r}: the snippet is found {count} times in {brk.path}, not once "
                         f"(the code changed); update BREAKS:\n{brk.snippet}")
    return source


def copy_repository(target):
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, target / name)


def failed_tests(output):
    return sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE)))


def first_error(output):
    """The first `E   ...` line of pytest's report: what the failing assertion said."""
    lines = [line.strip() for line in re.findall(r"^E[ \t]+(.*)$", output, flags=re.MULTILINE)]
    lines = [line for line in lines if line and line not in ("AssertionError:", "AssertionError")]
    return lines[0][:120] if lines else ""


def run_break(brk, python):
    """Applies `brk` to a copy of the repository and runs its tests there; returns a result dict."""
    check_snippet(brk)
    with tempfile.TemporaryDirectory(prefix=f"kb_mutation_{brk.name}_") as tmp:
        tmp = Path(tmp)
        copy_repository(tmp)
        target = tmp / brk.path
        target.write_text(check_snippet(brk, tmp).replace(brk.snippet, brk.replacement))
        # KB_TESTS_SEPARATE_LAUNCHES: a test that reads a scenario of a shared Horovod launch
        # (tests/launch.py) gets a launch with that scenario alone, not the whole shared one
        env = dict(os.environ, PYTHONPATH=str(tmp), TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
                   KB_TESTS_SEPARATE_LAUNCHES="1")
        command = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--timeout={brk.timeout}",
                   "-rfE", *brk.tests]
        start = time.monotonic()
        try:
            completed = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True,
                                       timeout=brk.timeout + 60, start_new_session=True)
            output, code = completed.stdout + completed.stderr, completed.returncode
        except subprocess.TimeoutExpired as expired:
            output, code = (expired.stdout or "") if isinstance(expired.stdout, str) else "", "timeout"
        elapsed = time.monotonic() - start
    failures = failed_tests(output)
    # exit code 1: tests failed (caught); 0: all passed (missed); anything else: a broken run
    caught = code == 1 and bool(failures)
    return {"name": brk.name, "caught": caught, "failed": failures, "code": code, "seconds": elapsed,
            "error": first_error(output), "tail": output[-3000:]}


def table(results):
    lines = ["| break | caught | tests that failed | first error | seconds |", "|---|---|---|---|---|"]
    for r in results:
        failed = "<br>".join(f"`{t}`" for t in r["failed"]) or f"none (pytest exit {r['code']})"
        error = r["error"].replace("|", "\\|").replace("`", "'")
        lines.append(f"| `{r['name']}` | {'yes' if r['caught'] else '**NO**'} | {failed} | {error} "
                     f"| {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the breaks and the tests that must catch them")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this break (repeatable)")
    parser.add_argument("--verify", action="store_true", help="only check that every snippet is still in the source")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table to FILE (e.g. a copy for docs/)")
    parser.add_argument("--python", default=sys.executable, help="the Python with TF, Keras, Horovod and pytest")
    args = parser.parse_args(argv)

    names = by_name()
    if args.list:
        for brk in BREAKS:
            print(f"{brk.name}: {brk.what}\n    {brk.path}\n    tests: {' '.join(brk.tests)}")
        return 0
    for brk in BREAKS:  # every snippet must still be in the source, whatever runs
        check_snippet(brk)
    if args.verify:
        print(f"all {len(BREAKS)} snippets found")
        return 0
    unknown = [n for n in args.only or () if n not in names]
    if unknown:
        parser.error(f"unknown break(s) {unknown}; --list shows them")
    selected = [names[n] for n in args.only] if args.only else list(BREAKS)

    results = []
    for brk in selected:
        print(f"[mutation] {brk.name}: {brk.what} ...", flush=True)
        result = run_break(brk, args.python)
        verdict = ("caught by " + ", ".join(result["failed"]) + f": {result['error']}" if result["caught"]
                   else "NOT CAUGHT")
        print(f"[mutation] {brk.name}: {verdict} ({result['seconds']:.0f} s)", flush=True)
        if not result["caught"]:
            print(result["tail"], flush=True)
        results.append(result)
    print()
    print(table(results))
    if args.markdown:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        command = " ".join(["scripts/mutation_check.py", *(argv if argv is not None else sys.argv[1:])])
        Path(args.markdown).write_text(f"Command: `{command}`, {stamp}, {len(results)} breaks, "
                                       f"{sum(r['seconds'] for r in results) / 60:.1f} minutes.\n\n"
                                       + table(results) + "\n")
    missed = [r["name"] for r in results if not r["caught"]]
    if missed:
        print(f"\nNOT CAUGHT: {', '.join(missed)}")
        return 1
    print(f"\nall {len(results)} breaks caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
