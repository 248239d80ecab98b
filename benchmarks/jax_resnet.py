"""A hand-written JAX ResNet: the "plain JAX NHWC" rows of ``bench_resnet.py``.

The network of :func:`synk_lasagne.models.build_resnet` (same depths, widths, strides, padding,
projections, batch norm with batch statistics and ``epsilon=1e-5``: given the same weights it
computes the same loss, ``test_lasagne_resnet.py`` checks it) written directly in JAX, the
way a JAX user writes it for speed: images NHWC, filters HWIO, and one ``jax.jit`` step that
donates its parameters, momenta and batch-norm statistics so that XLA updates them in place.  The
training step is the benchmark's: softmax cross-entropy, SGD with momentum 0.9 and learning rate
0.01.

Under ``bf16=True`` it is the policy of ``precision="bf16"`` (:mod:`synkhronos.precision`) by
hand: parameters stay float32 and are cast to bfloat16 where a convolution or the dense layer
reads them; activations are bfloat16; batch norm's statistics, the logits, the loss, the
gradients and the updates are float32.

>>> import numpy as np, jax
>>> step, carry = make_training(10, width=4, n_classes=3, image_size=32)
>>> x = np.zeros((2, 32, 32, 3), np.float32); y = np.array([0, 2], np.int32)
>>> carry, loss = step(carry, x, y)
>>> round(float(loss), 3) == round(float(np.log(3.0)), 3)  # zero images: equal logits
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from synk_lasagne.models.resnet import DEPTHS

__all__ = ["make_training"]

EPSILON = 1e-5
"""Batch norm's epsilon, as :func:`synk_lasagne.models.build_resnet`."""
ALPHA = 0.1
"""Batch norm's running averages: ``(1 - ALPHA) * running + ALPHA * batch``, as Lasagne's."""

Block = tuple[str, int, bool]
"""One residual block of the plan: (name prefix, stride, whether it has a projection shortcut)."""


def _he(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int, gain: float) -> np.ndarray:
    """He-normal weights: standard deviation ``gain * sqrt(1 / fan_in)``."""
    return (rng.standard_normal(shape) * gain * np.sqrt(1.0 / fan_in)).astype(np.float32)


def init(depth: int, width: int, n_classes: int,
         seed: int = 0) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]], list[Block]]:
    """Parameters, batch-norm statistics and the block plan of the ResNet of ``depth``.

    Every convolution ``name`` has ``params[name] = {"w" (HWIO), "gamma", "beta"}`` and
    ``state[name] = {"mean", "var"}``; the dense layer is ``params["fc"] = {"w", "b"}``."""
    kind, counts = DEPTHS[depth]
    rng = np.random.default_rng(seed)
    params: dict[str, dict[str, np.ndarray]] = {}
    state: dict[str, dict[str, np.ndarray]] = {}

    def conv_bn(name: str, size: int, c_in: int, c_out: int) -> None:
        params[name] = {"w": _he(rng, (size, size, c_in, c_out), size * size * c_in, np.sqrt(2.0)),
                        "gamma": np.ones(c_out, np.float32), "beta": np.zeros(c_out, np.float32)}
        state[name] = {"mean": np.zeros(c_out, np.float32), "var": np.ones(c_out, np.float32)}

    conv_bn("conv1", 7, 3, width)
    plan: list[Block] = []
    c_in = width
    for stage, count in enumerate(counts):
        for i in range(count):
            w, stride, name = width * 2 ** stage, 2 if stage > 0 and i == 0 else 1, f"stage{stage + 1}.{i}"
            c_out = w * 4 if kind == "bottleneck" else w
            sizes = [(1, c_in, w), (3, w, w), (1, w, c_out)] if kind == "bottleneck" else [(3, c_in, w), (3, w, c_out)]
            for j, (size, a, b) in enumerate(sizes):
                conv_bn(f"{name}.conv{j + 1}", size, a, b)
            projection = stride != 1 or c_in != c_out
            if projection:
                conv_bn(f"{name}.proj", 1, c_in, c_out)
            plan.append((name, stride, projection))
            c_in = c_out
    params["fc"] = {"w": _he(rng, (c_in, n_classes), c_in, 1.0), "b": np.zeros(n_classes, np.float32)}
    return params, state, plan


def make_training(depth: int = 50, width: int = 64, n_classes: int = 1000, image_size: int = 224,
                  bf16: bool = False, seed: int = 0,
                  weights: dict[str, dict[str, np.ndarray]] | None = None) -> tuple[Callable[..., Any], Any]:
    """The jitted step ``step(carry, x, y) -> (carry, loss)`` and its first carry on JAX's default
    device; ``x`` is ``(batch, image_size, image_size, 3)`` float32, ``y`` int32 labels; the loss
    is the one before the step's update.

    ``weights``: the initial parameters, laid out as :func:`init`'s (default: :func:`init`'s from
    ``seed``).  ``carry`` (parameters, momenta, batch-norm statistics) is donated: pass each step
    the carry the previous one returned."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    if image_size < 32:
        raise ValueError(f"image_size must be >= 32 (the image shrinks 32x), got {image_size}")
    kind = DEPTHS[depth][0]
    compute = jnp.bfloat16 if bf16 else jnp.float32
    params, state, plan = init(depth, width, n_classes, seed)
    params = params if weights is None else weights

    def forward(params: Any, state: Any, x: Any) -> tuple[Any, Any]:
        new_state = {}

        def conv_bn(name: str, h: Any, stride: int = 1, relu: bool = True) -> Any:
            p, s = params[name], state[name]
            pad = p["w"].shape[0] // 2  # symmetric, as Lasagne's and torchvision's
            z = lax.conv_general_dilated(h, p["w"].astype(compute), (stride, stride), [(pad, pad)] * 2,
                                         dimension_numbers=("NHWC", "HWIO", "NHWC")).astype(jnp.float32)
            mean = z.mean((0, 1, 2))
            var = jnp.square(z - mean).mean((0, 1, 2))
            new_state[name] = {"mean": (1 - ALPHA) * s["mean"] + ALPHA * mean,
                               "var": (1 - ALPHA) * s["var"] + ALPHA * var}
            scale = p["gamma"] * lax.rsqrt(var + EPSILON)
            out = z * scale + (p["beta"] - mean * scale)
            return (jnp.maximum(out, 0) if relu else out).astype(compute)

        h = conv_bn("conv1", x.astype(compute), 2)
        h = lax.reduce_window(h, np.array(-np.inf, compute), lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                              ((0, 0), (1, 1), (1, 1), (0, 0)))
        for name, stride, projection in plan:
            r = conv_bn(f"{name}.conv1", h, 1 if kind == "bottleneck" else stride)
            if kind == "bottleneck":
                r = conv_bn(f"{name}.conv2", r, stride)
                r = conv_bn(f"{name}.conv3", r, relu=False)
            else:
                r = conv_bn(f"{name}.conv2", r, relu=False)
            shortcut = conv_bn(f"{name}.proj", h, stride, relu=False) if projection else h
            h = jnp.maximum(r + shortcut, 0)
        pooled = h.astype(jnp.float32).mean((1, 2))
        logits = jnp.dot(pooled.astype(compute), params["fc"]["w"].astype(compute),
                         preferred_element_type=jnp.float32) + params["fc"]["b"]
        return logits, new_state

    def loss_fn(params: Any, state: Any, x: Any, y: Any) -> tuple[Any, Any]:
        logits, new_state = forward(params, state, x)
        log_p = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(log_p, y[:, None], axis=1).mean(), new_state

    def step(carry: Any, x: Any, y: Any) -> tuple[Any, Any]:
        params, velocity, state = carry
        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, y)
        velocity = jax.tree_util.tree_map(lambda v, g: 0.9 * v - 0.01 * g, velocity, grads)
        params = jax.tree_util.tree_map(lambda p, v: p + v, params, velocity)
        return (params, velocity, new_state), loss

    velocity = jax.tree_util.tree_map(np.zeros_like, params)
    carry = jax.device_put((params, velocity, state))
    return jax.jit(step, donate_argnums=0), carry
