"""A weight update's path into the engine: rank 0's one copy of each tensor (harness.rollout.sync `_Stream`,
harness.rollout.transfer `Packer`) and the vLLM engine's load path (`VLLMEngine(load_path=...)`,
harness/rollout/vllm_server.py).

On CPU: the device transports' packing gives the host path's buckets bit for bit, for every `_Stream`
variant that transforms tensors; the load path is validated before any process starts, "in-place" is
refused on CPU, the choice the server makes from vLLM's modules (fakes of vLLM 0.26.0's classes), the
dispatch and the fused-group hold of `Server.load`, and what the engine reports. On CUDA (`-m gpu`): either
load path syncs the engine to the policy bit for bit, the default is in-place.
"""
from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from harness.rollout.transfer import ALIGN, Packer
from harness.rollout.vllm_engine import LOAD_PATHS, VLLMEngine, check_load_path

MODEL = "tiny-qwen3-hd32"


# ------------------------------------------------------------------------------ export: one copy
def test_a_bucket_is_packed_one_tensor_at_a_time_at_aligned_offsets():
    tensors = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)),
               ("c", torch.randn(4, 6).to(torch.bfloat16).t()), ("d", torch.ones(()))]  # c: not contiguous
    packer = Packer(1)  # too small: it grows, and what it packed before stays
    packed = [packer.add(name, t) for name, t in tensors]
    buffer, wire = packer.layout()
    assert wire.specs == [("a", "float32", (3, 5), 0), ("b", "int64", (7,), ALIGN),
                          ("c", "bfloat16", (6, 4), 2 * ALIGN), ("d", "float32", (), 3 * ALIGN)]
    assert wire.nbytes == buffer.numel() == 3 * ALIGN + 4
    for (name, t), (_, view), copy in zip(tensors, wire.views(buffer), packed):
        assert torch.equal(view, t) and torch.equal(copy, t)
    _, only = packer.layout(["b", "d"])  # a bucket's layout cut to some tensors: the bytes all travel
    assert only.names == ["b", "d"] and only.nbytes == wire.nbytes
    with pytest.raises(ValueError, match="nothing to send"):
        Packer(8).layout()
    with pytest.raises(ValueError, match="tensors of one device"):
        other = Packer(8)
        other.add("x", torch.ones(1))
        other.add("y", torch.ones(1, device="meta"))


def _overwritten_after_each_item(items):
    """The bridge's contract at its strictest (harness.bridge.iter_hf_weights: a tensor is valid until the
    next item): every tensor a view of one buffer per dtype, which the next item first fills with 0xFF."""
    scratch: dict = {}
    for name, tensor in items:
        key = (tensor.dtype, tensor.device)
        if key not in scratch or scratch[key].numel() < tensor.numel():
            scratch[key] = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        for buffer in scratch.values():
            buffer.view(torch.uint8).fill_(0xFF)
        view = scratch[key][:tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        yield name, view


def _buckets(worker, bucket_bytes: int, variant: str | None, on_device: bool, strict: bool = True):
    """Rank 0's buckets of one export walk, as (name, CPU copy) pairs: from the packed buffer's layout
    on a device transport (the single copy), as kept otherwise (host). `strict`: the bridge's tensors
    overwritten after each item."""
    import torch.distributed as dist

    from harness.rollout.sync import _Stream

    stream = _Stream(worker.models, bucket_bytes, variant, on_device=on_device)
    if strict:
        stream.items = _overwritten_after_each_item(stream.items)
    out, done = [], False
    while not done:
        bucket, done = stream.next_bucket()
        if on_device and bucket and dist.get_rank() == 0:
            buffer, wire = stream.packed(bucket)
            bucket = wire.views(buffer)
        out.append([(name, tensor.cpu().clone()) for name, tensor in bucket] if dist.get_rank() == 0 else None)
    return out


CASES = [("tp2", "tiny-qwen3", (None, "sync-swapped-gate-up", "sync-qkv-not-grouped", "sync-swapped-tp-shards")),
         ("pp2", "tiny-qwen3-tied", (None, "sync-unsynced-tied-embedding")),
         ("dp2ep2", "tiny-qwen3-moe", ("sync-expert-group-split", "sync-experts-misordered"))]


@pytest.mark.parametrize("layout, model, variants", CASES, ids=[c[0] for c in CASES])
def test_the_device_transports_pack_what_the_host_path_sends(policy, device, layout, model, variants):
    """cuda-ipc and broadcast copy each tensor once, into the bucket's packed buffer (the variants that
    hold a tensor past its item copy it): the same cuts, names and values as the host path's copies, also
    when the bridge overwrites each tensor once it yields the next."""
    p = policy(layout, model)
    for variant in variants:
        expected = p.apply(_buckets, 4096, variant, False, False)[0]
        for on_device in (False, True):
            got = p.apply(_buckets, 4096, variant, on_device)[0]
            assert len(got) == len(expected) > 10, (variant, on_device)
            for a, b in zip(expected, got):
                assert [n for n, _ in a] == [n for n, _ in b], (variant, on_device)
                assert all(x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(a, b)), \
                    (variant, on_device, [n for (n, x), (_, y) in zip(a, b) if not torch.equal(x, y)])


# ------------------------------------------------------------------------------ the engine's load path
def test_the_load_path_is_refused_before_any_process_starts(monkeypatch):
    def no_start(self, kwargs, timeout):
        raise AssertionError("an engine process was started")

    monkeypatch.setattr(VLLMEngine, "_start", no_start)
    assert LOAD_PATHS == ("reload", "in-place")
    for device in ("cpu", "cuda"):
        check_load_path(None, device)
        check_load_path("reload", device)
    check_load_path("in-place", "cuda")
    with pytest.raises(ValueError, match=r"load_path must be one of \('reload', 'in-place'\)"):
        VLLMEngine(MODEL, load_path="fast")
    with pytest.raises(ValueError) as refused:
        VLLMEngine(MODEL, load_path="in-place")
    assert str(refused.value).startswith("load_path='in-place' needs device='cuda': vLLM on CPU prepacks")
    assert len(str(refused.value).splitlines()) == 1


@pytest.fixture(scope="module")
def server_module():
    with mock.patch.dict(os.environ):  # the server sets vLLM's variables for its own process
        from harness.rollout import vllm_server
    return vllm_server


def _method(kind: str, **attributes):
    return type(kind, (), {})() if not attributes else type(kind, (), dict(attributes))()


def _fake_server(module, device="cuda", methods=(), model_class="Qwen3ForCausalLM", quantization=None,
                 cache_dtype="auto", workarounds=()):
    """A Server without vLLM: `methods` are the quant methods of the model's layers (vLLM 0.26.0's class
    names), `llm` answers apply_model and collective_rpc and records them."""
    model = type(model_class, (torch.nn.Module,), {"load_weights": lambda self, weights: {n for n, _ in weights}})()
    for i, method in enumerate(methods):
        layer = torch.nn.Module()
        layer.quant_method = method
        model.add_module(f"layer{i}", layer)
    calls = []
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(quantization=quantization),
            cache_config=SimpleNamespace(cache_dtype=cache_dtype))),
        apply_model=lambda fn: calls.append(("apply_model", fn)) or [fn(model)],
        collective_rpc=lambda name, kwargs: calls.append((name, kwargs)),
        reset_prefix_cache=lambda: calls.append(("reset_prefix_cache", None)))
    server = object.__new__(module.Server)
    server.device, server.workarounds, server.llm, server.calls = device, list(workarounds), llm, calls
    return server


LINEAR = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def _moe(backend: str):
    return _method("UnquantizedFusedMoEMethod", unquantized_backend=SimpleNamespace(name=backend))


def test_the_server_loads_in_place_on_cuda_only_where_the_loaded_layout_is_the_kernels(server_module):
    dense = [_method(kind) for kind in LINEAR]
    server = _fake_server(server_module, methods=dense)
    assert server._load_path(None) == ("in-place", "default on CUDA: an unquantized model whose loaded layout is "
                                                   "its kernels' layout")
    assert server._load_path("reload") == ("reload", "asked for")
    assert server._load_path("in-place") == ("in-place", "asked for")
    # a MoE layer on the Triton backend (also behind the modular wrapper) loads in place; FlashInfer's does not
    triton = _fake_server(server_module, methods=dense + [_moe("TRITON"), _method("FusedMoEModularMethod",
                                                                                 old_quant_method=_moe("TRITON"))],
                          model_class="Qwen3MoeForCausalLM")
    assert triton._load_path(None)[0] == "in-place"
    # gpt-oss's load_weights copies its experts and sinks into the live parameters (read in vLLM 0.26.0)
    gpt_oss = _fake_server(server_module, methods=dense + [_moe("TRITON")], model_class="GptOssForCausalLM")
    assert gpt_oss._load_path(None)[0] == "in-place"
    refused = {
        "flashinfer": _fake_server(server_module, methods=dense + [_moe("FLASHINFER_CUTLASS")],
                                   model_class="Qwen3MoeForCausalLM"),
        "fp8 linear": _fake_server(server_module, methods=[_method("Fp8LinearMethod")]),
        "quantized": _fake_server(server_module, methods=dense, quantization="fp8"),
        "kv cache": _fake_server(server_module, methods=dense, cache_dtype="fp8"),
        "model": _fake_server(server_module, methods=dense, model_class="Glm4MoeForCausalLM"),
        "cpu": _fake_server(server_module, device="cpu", methods=dense),
    }
    reasons = {
        "flashinfer": "layer2: UnquantizedFusedMoEMethod (FLASHINFER_CUTLASS)",
        "fp8 linear": "layer0: Fp8LinearMethod",
        "quantized": "a quantized model (fp8)",
        "kv cache": "a quantized KV cache (fp8)",
        "model": "Glm4MoeForCausalLM's load_weights was not read",
        "cpu": "on CPU vLLM prepacks every linear weight for oneDNN",
    }
    for what, fake in refused.items():
        path, reason = fake._load_path(None)
        assert path == "reload" and reason.startswith("default: in-place is not valid: ") and reasons[what] in reason
        assert fake._load_path("reload")[0] == "reload"
        with pytest.raises(ValueError, match=r"load_path='in-place' is not valid for this engine: .*"
                           + reasons[what].replace("(", r"\(").replace(")", r"\)")):
            fake._load_path("in-place")
    with pytest.raises(ValueError, match="load_path must be one of"):
        server._load_path("fast")


def test_the_server_dispatches_each_load_and_holds_a_fused_group_as_a_copy(server_module):
    prefix = "model.layers.0.self_attn."
    names = [f"{prefix}{p}_proj.weight" for p in "qkv"] + ["model.norm.weight"]
    for load_path in LOAD_PATHS:
        server = _fake_server(server_module, device="cpu")
        server.load_path, server.pending, server.stale_kv = load_path, {}, False
        server.index_groups({**{name: f"{prefix}qkv_proj" for name in names[:3]}, names[3]: "model.norm"})
        shared = torch.zeros(4)  # a shared buffer's view: reused once the call returns
        assert server.load([(names[0], shared[:2]), (names[3], shared[2:])]) == 1
        shared.fill_(7)
        held = server.pending[f"{prefix}qkv_proj"][names[0]]
        assert server.pending_names() == [names[0]] and torch.equal(held, torch.zeros(2))  # as it was sent
        assert server.load([(names[1], torch.ones(2)), (names[2], torch.ones(2))]) == 3
        loads = [call for call in server.calls if call[0] in ("apply_model", "reload_weights")]
        assert [call[0] for call in loads] == ["apply_model" if load_path == "in-place" else "reload_weights"] * 2
        if load_path == "reload":
            assert [n for n, _ in loads[1][1]["weights_iterator"]] == names[:3]
        assert server.pending == {} and server.stale_kv and server.calls[-1][0] == "reset_prefix_cache"


def test_in_place_loading_is_the_models_own_load_weights_without_autograd(server_module):
    seen = []

    class Model(torch.nn.Module):
        def load_weights(self, weights):
            seen.append((torch.is_grad_enabled(), list(weights)))
            return {name for name, _ in seen[-1][1]}

    pair = ("model.norm.weight", torch.ones(2))
    assert server_module._load_in_place([pair], Model()) == {"model.norm.weight"}
    assert seen == [(False, [pair])]


def test_the_engine_reports_its_load_path(rollout, device):
    engine = rollout(MODEL, engine="vllm")
    expected = "in-place" if device == "cuda" else "reload"
    assert engine.load_path == expected and engine.load_path_reason.startswith("default")


# ------------------------------------------------------------------------------ CUDA: either path
@pytest.mark.layouts(cuda=["tp1"])
@pytest.mark.parametrize("load_path", LOAD_PATHS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_either_load_path_syncs_the_engine_to_the_policy(policy, device, layout, load_path, dtype, report):
    """vLLM 0.26.0 on the trainer's GPU (cuda-ipc), the load path forced: after a step, a sync, a
    sleep/wake round trip, every engine tensor equals the policy's export, the logprobs match, a
    re-sync changes nothing (harness.rollout.check)."""
    from harness.rollout.check import sync_check

    result = sync_check(policy, layout, dtype, device=device, model=MODEL, engine="vllm",
                        engine_options={"load_path": load_path})
    for row in result.rows():
        report.add(row.metric, row.value, tolerance=row.tolerance, passed=row.passed, claim=row.claim,
                   layout=row.layout, model=row.model, dtype=row.dtype, device=row.device,
                   **row.extra)  # the rows name the load path (SyncResult.rows)
    assert result.passed, result.summary()
    assert result.report.load_path == load_path and result.report.buckets > 10
