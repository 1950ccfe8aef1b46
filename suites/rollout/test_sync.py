"""Weight sync from every layout: after a training step and a sync the engine holds the policy's
exported weights bit for bit, its logprobs of its own samples match the trainer's, and a second
sync with no step changes nothing (harness.rollout.check). The catalog's weight-sync variants fail
the same check: suites/sensitivity."""
from __future__ import annotations

import pytest

from harness.pytest_plugin.worlds import skip_invalid_layout, skip_unless_converted
from harness.rollout import HFEngine, sync_weights
from harness.rollout.check import sync_check
from harness.variants import VariantError


def _record(report, result):
    for row in result.rows():
        report.add(row.metric, row.value, tolerance=row.tolerance, passed=row.passed, claim=row.claim, layout=row.layout,
                   model=row.model, dtype=row.dtype, device=row.device, **row.extra)


# 4 ranks on the CPU tier nightly: the step's micro-batches and rows, and the TP4-valid model, follow the
# layout (harness.rollout.check.step_shape, model_for), as on 4 GPUs.
@pytest.mark.layouts(cpu=["tp2", "pp2", "dp2"] + [pytest.param(name, marks=pytest.mark.nightly)
                                                  for name in ("dp4", "pp2vpp2dp2", "tp4", "tp4-sp")], cuda="all")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_synced_engine_equals_the_trained_policy(policy, device, layout, dtype, report):
    with skip_invalid_layout():  # pp4vpp2 (8 virtual stages) on a 4-layer model
        result = sync_check(policy, layout, dtype, device=device)
    _record(report, result)
    assert result.passed, result.summary()
    assert result.report.buckets > 10  # small buckets: the stream really is cut


@pytest.mark.layouts(cpu=["pp2"], cuda=["pp2", "pp2vpp2"])
def test_a_tied_model_under_pp_syncs_its_one_embedding(policy, device, layout, report):
    result = sync_check(policy, layout, "fp32", device=device, model="tiny-qwen3-tied", steps=2)
    _record(report, result)
    assert result.passed, result.summary()
    assert "lm_head.weight" not in result.report.names and "model.embed_tokens.weight" in result.report.names


@pytest.mark.layouts(cpu=["tp2"], cuda=["tp2"])
def test_buckets_stay_under_their_bound_and_carry_every_tensor_once(policy, rollout, device, layout):
    p = policy(layout, lr=1e-3)
    engine = rollout("tiny-qwen3")
    exported = p.hf_state_dict()
    largest = max(t.numel() * t.element_size() for t in exported.values())
    seen = []
    report = sync_weights(p, engine, bucket_bytes=20_000, progress=lambda r: seen.append(r.buckets))
    assert seen == list(range(1, report.buckets + 1))
    assert report.max_bucket_bytes <= max(20_000, 2 * largest)  # a fused gate_up is two tensors in one
    assert len(report.names) == len(set(report.names))
    unfused = {n for n in exported if not n.endswith(("gate_proj.weight", "up_proj.weight"))}
    assert unfused <= set(report.names) and report.bytes == sum(t.numel() * t.element_size() for t in exported.values())


@pytest.mark.layouts(cpu=["dp2"], cuda=["dp2"])
def test_bad_sync_input_is_one_clear_error_before_any_work(policy, device, layout):
    p = policy(layout)
    engine = HFEngine("tiny-qwen3")
    with pytest.raises(ValueError, match="bucket_bytes must be a positive integer"):
        sync_weights(p, engine, bucket_bytes=0)
    with pytest.raises(VariantError, match="needs tensor parallelism"):
        sync_weights(p, engine, variant="sync-swapped-tp-shards")
    with pytest.raises(VariantError, match="is a training variant"):
        sync_weights(p, engine, variant="no-finalize-grads")
    p.offload(params=True, grads=False, optimizer=False)
    from harness.offload import OffloadedError

    with pytest.raises(OffloadedError, match="weight sync"):
        sync_weights(p, engine)
    p.reload()


# Gemma 3 text (issue 37; stack A only: refused by name on Megatron-Bridge 0.6.2), HF engine: the trained
# post-norms and zero-centered norms reach the engine under their HF names (post_attention_layernorm,
# pre/post_feedforward_layernorm), and its logprobs (with the sliding window, the embedding scale) match the
# trainer's. CI: pp2 in fp32 (the tied embedding under PP, every norm kind, both RoPE bases); nightly the rest.
@pytest.mark.layouts(cpu=["pp2", pytest.param("tp2", marks=pytest.mark.nightly),
                          pytest.param("dp2", marks=pytest.mark.nightly)], cuda=["pp2", "tp2"])
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.nightly)])
def test_a_synced_engine_equals_the_trained_gemma3_policy(policy, device, layout, dtype, report):

    skip_unless_converted("tiny-gemma3")
    if policy.spec != "local":
        pytest.skip("harness.bridge.gemma3 builds Gemma 3 on the local spec only (docs/gemma3.md)")
    result = sync_check(policy, layout, dtype, device=device, model="tiny-gemma3")
    _record(report, result)
    assert result.passed, result.summary()
    names = set(result.report.names)
    assert {"model.layers.3.post_feedforward_layernorm.weight", "model.layers.0.pre_feedforward_layernorm.weight",
            "model.layers.2.post_attention_layernorm.weight", "model.layers.1.self_attn.k_norm.weight"} <= names
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_the_broadcast_groups_store_holds_its_port_from_the_moment_it_is_named():
    """The separate placement's group: rank 0's TCPStore binds a port of the OS's choosing before the
    engine is told it, so no other process can take it in between (a port probed free and bound later was
    taken on a 4x H100: EADDRINUSE, reports/gpu/2026-11-27-h100x4-sync-walk)."""
    import errno
    import socket

    from harness.rollout.transfer import serve_store

    store = serve_store("127.0.0.1", timeout_s=30)
    assert store.port > 0
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", store.port))
    assert taken.value.errno == errno.EADDRINUSE
