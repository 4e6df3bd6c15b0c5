"""The compute-path pass: which kernels run a loaded model, set on it from outside rather than built into it.

`install_packed` swaps the linears whose checkpoint weights came packed (GGUF blocks, int8, int4) for PackedLinear
layers; `use_compute_path` sets the model's attention backend and element-wise layer ops, runs its packed linears
through statelm's kernel or through torch on a dequantized copy, and (on the kernels path, all linears packed) fuses
its decoder layers into one C++ call; `use_activations` sets how the packed matmuls treat activations and
`use_repack` whether they read interleaved copies of their blocks. The start-up
self-check (invariance.py) picks the path. An architecture takes the pass by naming its parts as the Llama family
does: `backend`, `ops`, `fused`, `chunking`, `activations`, `compute_path`, `embed_tokens`, `lm_head`, `packed_head`,
and the fused linears of its weight map (`linear_groups`).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from statelm.attention.base import AttentionBackend
from statelm.attention.reference import TorchAttentionBackend
from statelm.kernels.build import kernels_available
from statelm.models.fused_decoder import FusedDecoder
from statelm.models.layers import KernelLayerOps, LayerOps, RowChunkedLinear, RowChunking, kernel_float_linear
from statelm.models.llama import LlamaForCausalLM
from statelm.models.moe import MoEMLP
from statelm.models.packed import ACTIVATIONS, PackedEmbedding, PackedLinear
from statelm.models.variants import VariantForCausalLM

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight


def compute_paths(model: LlamaForCausalLM) -> list[str]:
    """The compute paths this model can run, fastest first (the start-up self-check picks one).

    `kernels`: statelm's C++ kernels (float32 on the CPU); `triton`: statelm's Triton attention over the
    paged KV and torch's matmuls in fixed row chunks (CUDA; its forward is capturable in a CUDA graph);
    `torch`: torch's kernels in fixed row chunks; `torch-per-row`: every row its own call, invariant on any
    CPU but slow for prompts.
    """
    paths = ["torch", "torch-per-row"]
    on_cpu = model.device.type == "cpu"
    if on_cpu and model.dtype == torch.float32 and kernels_available():
        paths.insert(0, "kernels")
    if model.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        paths.insert(0, "triton")
    if isinstance(model, VariantForCausalLM):  # a feature the fast paths lack (docs/models.md)
        paths = [path for path in paths if path not in model.unsupported_paths()]
    return paths


def use_compute_path(model: LlamaForCausalLM, path: str) -> None:
    """Run the model's attention (and, once chosen, its linears) through one of compute_paths(model)."""
    backend: Callable[..., AttentionBackend]
    if path == "kernels":
        from statelm.attention.cpu_kernel import CpuKernelAttentionBackend

        backend = CpuKernelAttentionBackend
        model.ops = KernelLayerOps()
    elif path == "triton":
        from statelm.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend
        model.ops = LayerOps()
    else:
        model.ops = LayerOps()
        backend = functools.partial(TorchAttentionBackend, per_row=path == "torch-per-row")
    if isinstance(model, VariantForCausalLM):
        model.use_attention(backend)
    else:
        model.backend = backend(sliding_window=model.config.sliding_window)
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.use(kernel=path == "kernels")
    fusable = not isinstance(model, VariantForCausalLM) or model.fusable()  # blocks the fused decoder takes
    model.fused = FusedDecoder.build(model) if path == "kernels" and fusable else None
    if model.batch_invariant:
        sizes = RowChunking.per_row() if path == "torch-per-row" else RowChunking.batch_invariant(model.device)
        model.chunking.resize(sizes)
    model.compute_path = path


# `--activations auto` takes int8 for a model whose packed matrices hold at least this many weights (a 1B model's
# decoder layers: ~0.97 billion), int16-prompt below (docs/gguf.md says why).
AUTO_INT8_WEIGHTS = 500_000_000


def decoded_kv_exact(model: LlamaForCausalLM) -> bool:
    """Whether a token's K/V are the same bits computed in a generated row as in a prompt row, so that decoded
    tokens' K/V can serve as a prefill's (the prefix cache, a session's next turn): on the kernels path, whose
    attention and kernels give a row the same bits in any batch, where prompt and generated rows share one
    arithmetic (ACTIVATIONS: int8, float32) and no linear of the layers is a torch matmul (those split the two
    kinds of rows into chunks of different sizes, which round differently); a mixture's router is computed
    by torch.ops.statelm.float_linear, one fixed-order dot product an output."""
    prompt, generated = ACTIVATIONS[model.activations]
    if model.compute_path != "kernels" or prompt != generated:
        return False
    routers = {id(mlp.router) for mlp in model.layers.modules() if isinstance(mlp, MoEMLP)}
    return all(
        id(linear) in routers and kernel_float_linear(linear)
        for linear in model.layers.modules()
        if isinstance(linear, RowChunkedLinear)
    )


def use_activations(model: LlamaForCausalLM, activations: str) -> int:
    """How packed linears on the kernels path treat activations, prompt rows and generated rows (a key of
    ACTIVATIONS: `float32`, `int8` (per 32 values, 256 on K-quant blocks), `int8-decode` or `int16-prompt`, or
    `auto`: int8 from AUTO_INT8_WEIGHTS weights on, else int16-prompt; model.activations says which); returns how
    many packed linears there are (none: the setting changes nothing)."""
    if activations != "auto" and activations not in ACTIVATIONS:
        raise ValueError(f"unknown activations {activations!r}; choose auto, {', '.join(ACTIVATIONS)}")
    packed = [module for module in model.modules() if isinstance(module, PackedLinear)]
    if activations == "auto":
        weights = sum(module.in_features * module.out_features for module in packed)
        activations = "int8" if weights >= AUTO_INT8_WEIGHTS else "int16-prompt"
    for module in packed:
        module.activations = activations
    model.activations = activations
    return len(packed)


def use_repack(model: LlamaForCausalLM, repack: bool) -> None:
    """Whether packed linears run by the kernels read an interleaved copy of their blocks (--repack)."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.repack = repack
            if module.use_kernel and kernels_available():
                module.use(kernel=True)


def install_packed(model: LlamaForCausalLM, packed: dict[str, PackedWeight]) -> None:
    """Swap in packed layers for the packed weights load_weights left; a fused group with a float member is
    dequantized whole instead."""
    for owner, attribute, names in model.linear_groups():
        members = [packed.get(name) for name in names]
        if all(member is not None for member in members):
            fused = type(members[0]).concat(members) if len(members) > 1 else members[0]
            linear = getattr(owner, attribute)
            setattr(owner, attribute, PackedLinear(fused, linear.bias, model.chunking))
        else:
            for name in names:
                if name in packed:
                    model.copy_weight(name, packed[name].dequantize())
    embed = packed.get("model.embed_tokens.weight")
    head = packed.get("lm_head.weight", embed if model.lm_head is None else None)
    if head is not None:
        model.packed_head = PackedLinear(head, None, model.chunking)
        model.lm_head = None
    if embed is not None:
        model.embed_tokens = PackedEmbedding(embed, model.packed_head if head is embed else None)
