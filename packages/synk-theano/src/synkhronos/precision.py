"""Precision policies: how a float32 graph computes.

PyTensor has no bfloat16 type: users write float32 graphs.  A policy changes how such a graph
computes, not the graph: it is a transformation of the JAX function that PyTensor's JAX
translation made (:func:`apply`), so every Op keeps its own translation.

=============  ===============================================================================
``"default"``  XLA's default: float32 products at the backend's default precision (TF32 tensor
               cores on Ampere and Hopper GPUs, float32 on CPUs).  The function is unchanged.
``"highest"``  Strict float32: every float32 product at ``lax.Precision.HIGHEST``.
``"bf16"``     Mixed precision with bfloat16 activations (as JAX's jmp policies, Keras's
               ``mixed_bfloat16`` and PyTorch's autocast): products and convolutions, and the
               element-wise work between them, compute and store bfloat16; reductions,
               precision-sensitive functions, parameters, optimizer state and the function's
               outputs stay float32.  The rules are below.
=============  ===============================================================================

The rules of ``"bf16"``, primitive by primitive (the values flowing between primitives are
bfloat16 or float32; the function's inputs are float32):

* **Products** (``dot_general``, ``conv_general_dilated``) of float32 (or bfloat16) operands take
  bfloat16 operands and make a bfloat16 result.  The backends accumulate in float32 inside (cuBLAS
  and cuDNN compute bfloat16 products with float32 accumulators, XLA's CPU backend upcasts); asking
  for a float32 result (``preferred_element_type=float32``) instead keeps every activation float32
  between products, and XLA's GPU compiler may then run the convolution in float32 altogether.
* **Element-wise and data-movement primitives** of ``_BF16_OPS`` (``add``, ``sub``, ``mul``,
  ``div``, ``max``, ``tanh``, ``logistic``, ``select_n``, comparisons, reshapes, transposes,
  slices, pads, gathers, max pooling...) with a bfloat16 operand run in bfloat16 where their other
  float operands are literals, scalars or weak-typed (these are rounded to bfloat16: a constant
  never upcasts an activation).  Where the other operands are *small* float32 arrays (holding fewer
  values than the result: per-channel batch-norm statistics, biases and scales broadcast against an
  activation, or broadcasts of constants such as ReLU's gradient mask) they compute in float32 and
  round the result to bfloat16 at once: XLA fuses the conversions, so the stored activation is
  bfloat16 and the arithmetic is float32's.  Where an operand is a float32 array of the result's
  size (a parameter, a velocity: ``param - lr * grad``) they compute in float32 and make float32.
  Division is among them: a quotient's relative error is the sum of its operands', small divisors
  included (bfloat16 has float32's exponent range).
* **Everything else computes in float32**, its bfloat16 operands converted back: reductions
  (``reduce_sum``, ``reduce_max``, ``argmax``, ``cumsum``: the means and variances of batch norm,
  softmax's and the loss's sums), transcendental and precision-sensitive functions (``exp``,
  ``log``, ``log1p``, ``expm1``, ``pow``, ``sqrt``, ``rsqrt``, ``erf``...: they amplify their
  operand's error or feed reductions), scatters, sorts, collectives (``psum``, callbacks: the
  gradients are summed in float32), and any primitive this module does not name.  A collective
  whose operand the function itself converts to bfloat16 (``ops.all_reduce(x, dtype="bfloat16")``)
  keeps it: an equation's operands are converted back only to the dtypes the function gives them,
  and a conversion from bfloat16 to float32 the function makes is kept.
* **Calls** (``jit``, ``remat``, ``custom_jvp_call``, ``custom_vjp_call``) are evaluated in place
  with the same rules, so bfloat16 values flow through them.  **Loops and branches** (``scan``,
  ``while``, ``cond``) and ``shard_map`` keep their float32 boundaries: their operands and carries
  are converted back to float32 and their bodies are rewritten with the same rules inside, each
  result converted back to its float32 type, so a carry's type never changes.
* The function's **outputs** (losses, updated parameters, optimizer state, running statistics)
  have the dtypes of the original function: float32.

Products of other dtypes (float64, integers) are left as they are under every policy.

Functions
    :func:`check`        a policy name, checked (``None``: ``"default"``)
    :func:`apply`        ``fn`` -> the same function under a policy (a jaxpr interpreter)
    :func:`jax_mode`     a PyTensor JAX mode whose compiled functions run under a policy
    :func:`compile_kwargs`  ``pytensor.function`` keyword arguments under a policy (the hook)
    :func:`check_backend`   the master's build-time check that a policy can apply

Example
-------
>>> import jax.numpy as jnp
>>> from synkhronos import precision
>>> f = precision.apply(lambda a, b: a @ b, "bf16")
>>> f(jnp.ones((2, 3)), jnp.ones((3, 2))).dtype
dtype('float32')

How ``apply`` works: the function is traced to a jaxpr at the shapes it is called with, and the
jaxpr is evaluated again equation by equation, each equation bound anew with the policy's operands
and parameters.  Sub-jaxprs of loops, branches and ``shard_map`` (and, under ``"highest"``, of
every primitive) are rewritten the same way wherever they hold a product, and their primitives
bound again with the rewritten jaxprs (same signatures, so the primitives' rules apply unchanged).
Under ``"bf16"`` the bodies of calls and custom-derivative functions are evaluated in place: the
transformed function computes the same values, but differentiating it with JAX afterwards would
differentiate those bodies rather than use their custom rules (PyTensor differentiates the graph
before it is translated, so a Synkhronos function never is).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from synkhronos.jaxpr_policy import _eval, _is_array

__all__ = ["POLICIES", "apply", "check", "check_backend", "compile_kwargs", "jax_mode", "policy_of"]

log = logging.getLogger("synkhronos")

POLICIES = ("default", "highest", "bf16")
"""The policies, by name (see the module docstring)."""


def check(precision: str | None) -> str:
    """``precision`` as a policy name (None: ``"default"``).

    Raises
    ------
    ValueError
        For a name not in :data:`POLICIES`.
    """
    if precision is None:
        return "default"
    if not isinstance(precision, str) or precision not in POLICIES:
        raise ValueError(f"precision must be one of {', '.join(repr(p) for p in POLICIES)}, got {precision!r}")
    return precision


# -- the transformation -------------------------------------------------------------------------
def apply(fn: Callable[..., Any], precision: str) -> Callable[..., Any]:
    """``fn`` (a function of JAX arrays) computing its products under ``precision``.

    ``"default"`` returns ``fn`` itself.  Otherwise each call traces ``fn`` at its arguments' shapes
    (inside ``jax.jit``: once per compilation) and evaluates the traced jaxpr with the policy.
    Arguments that are not arrays (Python numbers: PyTensor's static shape inputs) stay static.

    Parameters
    ----------
    fn : callable
        Arrays (and static Python values) -> a pytree of arrays.
    precision : str
        A name of :data:`POLICIES`.

    Returns
    -------
    callable
        Same arguments, same results' structure, shapes and dtypes.
    """
    policy = check(precision)
    if policy == "default":
        return fn
    import jax

    @functools.wraps(fn)
    def under_policy(*args: Any) -> Any:
        static = {i: a for i, a in enumerate(args) if not _is_array(a)}
        arrays = [a for i, a in enumerate(args) if i not in static]

        def with_static(*xs: Any) -> Any:
            it = iter(xs)
            return fn(*(static[i] if i in static else next(it) for i in range(len(args))))

        closed, shapes = jax.make_jaxpr(with_static, return_shape=True)(*arrays)
        outs = _eval(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(arrays), policy)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs)

    return under_policy


# -- PyTensor: the JAX linker and the mode ----------------------------------------------------------
@functools.cache
def _linker_class(policy: str) -> type:
    """PyTensor's ``JAXLinker`` whose jitted function runs under ``policy`` (one class per policy:
    PyTensor makes a linker of the same class, without arguments, for each function it compiles)."""
    from pytensor.link.jax.linker import JAXLinker

    def jit_compile(self: Any, fn: Any) -> Any:
        return JAXLinker.jit_compile(self, apply(fn, policy))

    return type(f"JAXLinker_{policy}", (JAXLinker,), {"precision": policy, "jit_compile": jit_compile,
                                                        "__module__": __name__})


def _is_jax_mode(mode: Any) -> bool:
    from pytensor.compile.mode import get_mode
    from pytensor.link.jax.linker import JAXLinker

    return isinstance(get_mode(mode).linker, JAXLinker)


def jax_mode(mode: Any, precision: str) -> Any:
    """``mode`` (``"JAX"`` or a JAX-linker Mode: its rewrites) compiling under ``precision``.

    Under a policy other than ``"default"`` the products stay JAX's own (CPU ranks' BLAS products,
    :mod:`synkhronos.blas`, are excluded), so that the policy reaches them.

    Raises
    ------
    ValueError
        Where ``mode`` does not compile with JAX.
    """
    policy = check(precision)
    if policy == "default":
        return mode
    from pytensor.compile.mode import Mode, get_mode

    if mode is None or not _is_jax_mode(mode):
        raise ValueError(_no_jax(policy, f"it compiles in PyTensor mode {mode!r}" if mode is not None
                                 else "it compiles in PyTensor's default mode (C/Numba), not JAX: JAX could "
                                      "not compile it (an exception above says why), or its in-graph "
                                      "collectives run outside JAX here"))
    from synkhronos.blas import TAG

    rewrites = get_mode(mode).excluding(TAG)
    return Mode(linker=_linker_class(policy)(), optimizer=rewrites.provided_optimizer)


def compile_kwargs(precision: str, kwargs: dict[str, Any], device: Any) -> dict[str, Any]:
    """The hook: ``pytensor.function`` keyword arguments (``mode`` already chosen by the rank's
    device) with the mode compiling under ``precision``.  The JAX engine's master compiles only to
    check graphs (its workers apply the policy): it keeps its mode."""
    if check(precision) == "default" or getattr(device, "kind", None) == "engine-master":
        return kwargs
    return {**kwargs, "mode": jax_mode(kwargs.get("mode"), precision)}


def policy_of(fn: Any) -> str:
    """The policy of a compiled PyTensor function (``"default"`` unless :func:`jax_mode` made its mode)."""
    return getattr(getattr(getattr(fn, "maker", None), "linker", None), "precision", "default")


def check_backend(precision: str, device: Any, mode: Any = None) -> None:
    """In the master, before any worker acts: raise where ``precision`` cannot apply.

    Every function of GPU mode and of the JAX engine compiles with JAX; CPU mode's per-rank
    engine does where its backend is ``"jax"`` (:func:`synkhronos.cpu.choose_backend`).

    Raises
    ------
    ValueError
        For a policy other than ``"default"`` with a ``mode`` that is not JAX, or CPU ranks that
        compile with PyTensor's default mode (C/Numba).
    """
    policy = check(precision)
    if policy == "default":
        return
    if mode is not None and not _is_jax_mode(mode):
        raise ValueError(_no_jax(policy, f"mode={mode!r} is not a JAX mode: leave mode out, or give mode='JAX'"))
    if device.use_gpu or getattr(device, "kind", None) == "engine-master":
        return
    backend = getattr(device, "backend", "jax")
    if backend != "jax":
        raise ValueError(_no_jax(policy, f"CPU mode's ranks compile with PyTensor's default mode (backend "
                                         f"{backend!r}): install JAX (pip install 'synk-theano[cpu]') and leave "
                                         "SYNK_CPU_BACKEND unset or set it to 'jax', with no mode in PYTENSOR_FLAGS"))


def _no_jax(policy: str, why: str) -> str:
    return (f"precision={policy!r} applies to functions compiled with JAX (PyTensor's mode='JAX'), but {why}. "
            "Use precision='default' for this function.")
