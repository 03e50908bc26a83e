"""Synthetic, LLM-like state dicts of a requested size, for benchmarks and demos.

The shapes follow a LLaMA-style decoder (hidden size ``d``, MLP size ``2.6875 d``, vocabulary
``7.8125 d`` — the ratios of 4096 / 11008 / 32000), scaled down until the model fits the
requested size: layer matrices in bfloat16, embeddings, output head and norms in float32,
so a checkpoint mixes large 2-D tensors with small 1-D ones as real ones do.

Example:
    >>> from fastckpt.bench.synthetic import llm_like_state_dict, state_dict_nbytes
    >>> sd = llm_like_state_dict(1 << 20)
    >>> abs(state_dict_nbytes(sd) - (1 << 20)) < 4096
    True
    >>> sd["model.layers.0.self_attn.q_proj.weight"].dtype
    torch.bfloat16
"""

from __future__ import annotations

from typing import Any

__all__ = ["MIN_NBYTES", "llm_like_state_dict", "plan_shapes", "random_layers", "state_dict_nbytes"]

# Hidden sizes tried, largest first; the first that fits a few layers is used.
_HIDDEN_SIZES = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8)
_MIN_LAYERS = 4
_MLP_RATIO = 11008 / 4096
_VOCAB_RATIO = 32000 / 4096
_POOL_ELEMENTS = 1 << 24


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _round8(x: float) -> int:
    return max(8, round(x / 8) * 8)


def _dims(d: int) -> tuple[int, int]:
    return _round8(d * _MLP_RATIO), _round8(d * _VOCAB_RATIO)


def _layer_bytes(d: int, ff: int) -> int:
    # q, k, v, o (d x d) and gate, up (ff x d), down (d x ff) in bfloat16; two float32 norms.
    return 2 * (4 * d * d + 3 * d * ff) + 4 * 2 * d


def _fixed_bytes(d: int, vocab: int) -> int:
    # Embedding and output head (vocab x d) and the final norm, in float32.
    return 4 * (2 * vocab * d + d)


#: The smallest size :func:`llm_like_state_dict` can build (one layer of hidden size 8).
MIN_NBYTES = _fixed_bytes(8, _dims(8)[1]) + _layer_bytes(8, _dims(8)[0])


def plan_shapes(nbytes: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Names, dtypes and shapes of a state dict of about ``nbytes`` (within ``8 * d`` bytes).

    The largest hidden size that fits at least four layers is chosen (one layer for the
    tiniest sizes), then as many layers as fit, then the vocabulary grows to take up the rest.

    Raises:
        ValueError: ``nbytes`` is below :data:`MIN_NBYTES`.

    Example:
        >>> plan = plan_shapes(1 << 30)
        >>> plan["model.embed_tokens.weight"]
        ('float32', (16119, 2048))
        >>> sum(1 for name in plan if name.endswith("q_proj.weight"))
        8
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < MIN_NBYTES:
        raise ValueError(f"an LLM-like state dict needs at least {MIN_NBYTES} bytes, got {nbytes}")
    for d in _HIDDEN_SIZES:
        ff, vocab = _dims(d)
        if _fixed_bytes(d, vocab) + _MIN_LAYERS * _layer_bytes(d, ff) <= nbytes:
            break
    # The loop ends on d = 8 when nothing larger fits; MIN_NBYTES guarantees one layer.
    layers = (nbytes - _fixed_bytes(d, vocab)) // _layer_bytes(d, ff)
    rest = nbytes - _fixed_bytes(d, vocab) - layers * _layer_bytes(d, ff)
    vocab += rest // (8 * d)

    plan: dict[str, tuple[str, tuple[int, ...]]] = {
        "model.embed_tokens.weight": ("float32", (vocab, d)),
    }
    for i in range(layers):
        prefix = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            plan[f"{prefix}self_attn.{proj}.weight"] = ("bfloat16", (d, d))
        plan[f"{prefix}mlp.gate_proj.weight"] = ("bfloat16", (ff, d))
        plan[f"{prefix}mlp.up_proj.weight"] = ("bfloat16", (ff, d))
        plan[f"{prefix}mlp.down_proj.weight"] = ("bfloat16", (d, ff))
        plan[f"{prefix}input_layernorm.weight"] = ("float32", (d,))
        plan[f"{prefix}post_attention_layernorm.weight"] = ("float32", (d,))
    plan["model.norm.weight"] = ("float32", (d,))
    plan["lm_head.weight"] = ("float32", (vocab, d))
    return plan


def llm_like_state_dict(nbytes: int, seed: int = 0) -> dict[str, Any]:
    """A ``str -> Tensor`` dict of about ``nbytes`` bytes shaped like an LLM's state dict.

    Values are normal, scaled like initialised weights (norms near 1), and depend only on
    ``seed``, so two calls give equal dicts. See :func:`plan_shapes` for the shapes.

    Drawing gigabytes of random numbers takes longer than writing them, so the values come
    from a pool of up to 16 Mi random numbers, each tensor starting at its own random
    place: the period (64 MiB) is far beyond what a file system's compression would find.

    Example:
        >>> sd = llm_like_state_dict(256 * 1024, seed=1)
        >>> sorted({str(t.dtype) for t in sd.values()})
        ['torch.bfloat16', 'torch.float32']
        >>> import torch
        >>> again = llm_like_state_dict(256 * 1024, seed=1)
        >>> all(torch.equal(sd[name], again[name]) for name in sd)
        True
    """
    return state_dict_from_shapes(plan_shapes(nbytes), seed)


def state_dict_from_shapes(
    plan: dict[str, tuple[str, tuple[int, ...]]], seed: int = 0
) -> dict[str, Any]:
    """Tensors of the given ``name -> (dtype name, shape)`` filled as described in
    :func:`llm_like_state_dict` (1-D tensors near one, the others N(0, 0.02)).

    Example:
        >>> sd = state_dict_from_shapes({"w": ("bfloat16", (4, 8)), "norm": ("float32", (8,))})
        >>> sd["w"].shape, bool((sd["norm"] > 0.5).all())
        (torch.Size([4, 8]), True)
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    total = sum(_numel(shape) for _, shape in plan.values())
    pool32 = torch.empty(max(1, min(total, _POOL_ELEMENTS)), dtype=torch.float32)
    pool32.normal_(0.0, 0.02, generator=generator)
    pools = {"float32": pool32, "bfloat16": pool32.to(torch.bfloat16)}
    state: dict[str, Any] = {}
    for name, (dtype_name, shape) in plan.items():
        pool = pools[dtype_name]
        tensor = torch.empty(shape, dtype=pool.dtype)
        flat = tensor.view(-1)
        start = int(torch.randint(0, pool.numel(), (1,), generator=generator))
        filled = 0
        while filled < flat.numel():
            take = min(flat.numel() - filled, pool.numel() - start)
            flat[filled : filled + take].copy_(pool[start : start + take])
            filled += take
            start = 0
        if len(shape) == 1:
            tensor += 1.0  # norm weights sit near one
        state[name] = tensor
    return state


def state_dict_nbytes(state: dict[str, Any]) -> int:
    """Total bytes of the tensors of a flat state dict.

    Example:
        >>> import torch
        >>> state_dict_nbytes({"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.bfloat16)})
        20
    """
    return sum(t.numel() * t.element_size() for t in state.values())


def random_layers(nbytes: int) -> dict[str, Any]:
    """About ``nbytes`` of random bf16 layers of 16 MiB each (at most 64 tensors): what
    ``fastckpt tune`` times its saves and loads with, shaped like an LLM's weights.

    Example:
        >>> state = random_layers(32 << 20)
        >>> len(state), state_dict_nbytes(state) == 32 << 20
        (2, True)
    """
    import torch

    tensors = max(1, min(64, nbytes >> 24))
    state = {
        f"layers.{i}.weight": torch.empty(nbytes // tensors // 2, dtype=torch.bfloat16)
        for i in range(tensors)
    }
    for t in state.values():
        t.view(torch.int16).random_()
    return state
