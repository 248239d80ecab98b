"""How far the ``"bf16"`` policy's gradients are from strict float32, parameter by parameter, beside
references that emulate bfloat16 by rounding float32 values (:mod:`synkhronos.precision`).

A small ResNet (``synk_lasagne.models.build_resnet``: batch norm with batch statistics, softmax
cross-entropy) on one batch of normal images; the gradient of the loss with respect to every
trainable parameter, compiled with PyTensor's JAX mode under each variant:

``fp32``      ``"highest"``: strict float32, the reference of every other row
``fp32b``     strict float32 on the inputs rounded to bfloat16 (the noise of a rounding of the data)
``bf16``      the ``"bf16"`` policy
``prod``      float32 everywhere, the operands of each product rounded to bfloat16 (products exact in
              float32: "ideal" bfloat16 products accumulating in float32)
``prod+out``  as ``prod``, each product's result also rounded to bfloat16 (activations stored bfloat16)
``emul``      the ``"bf16"`` policy's own rules, every value it makes bfloat16 computed in float32
              and rounded to bfloat16 (bfloat16 storage, float32 arithmetic everywhere)
``-OP``       the ``"bf16"`` policy with the primitive OP computing in float32 (bisection; ``-A+B``
              several, ``-ALL`` every element-wise one: only the products' results are bfloat16)
``noiseK``    strict float32 on the inputs times ``1 + 2**-K * uniform(-1, 1)`` (the gradients'
              sensitivity to a perturbation of the data of relative size ``2**-K``)

Prints, per parameter, the relative error ``|g - g_fp32| / |g_fp32|`` (2-norms), and per kind of
parameter (convolution W, batch-norm gamma/beta, dense W/b) the median and largest.

    python tools/probe_precision_grads.py --depth 10 --width 8 --image 32 --batch 4
    python tools/probe_precision_grads.py --variants fp32,bf16,emul,-sub,-mul
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=10)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--image", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="fp32,fp32b,bf16,prod,prod+out,emul")
    p.add_argument("--per-param", action="store_true", help="print every parameter's error")
    p.add_argument("--smooth", action="store_true",
                   help="softplus instead of ReLU and average instead of max pooling: no decision flips")
    return p.parse_args(argv)


def rounded(x: Any) -> Any:
    import jax.numpy as jnp

    return x.astype(jnp.bfloat16).astype(x.dtype) if x.dtype == jnp.float32 else x


def product_interpreter(fn: Callable[..., Any], round_out: bool) -> Callable[..., Any]:
    """``fn`` with each float32 product's operands rounded to bfloat16 and the product at
    ``Precision.HIGHEST`` (float32 accumulation); ``round_out``: its result rounded too."""
    import jax
    from jax import lax
    from jax.extend import core

    def run(jaxpr: Any, consts: Any, args: list[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, core.Literal) else env[v]

        for eqn in jaxpr.eqns:
            vals = [read(v) for v in eqn.invars]
            params = dict(eqn.params)
            name = eqn.primitive.name
            if name in ("dot_general", "conv_general_dilated") and vals[0].dtype == np.float32:
                params["precision"] = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
                out = eqn.primitive.bind(rounded(vals[0]), rounded(vals[1]), *vals[2:], **params)
                outs = [rounded(out) if round_out else out]
            elif name in ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"):
                body = params.get("jaxpr", params.get("call_jaxpr", params.get("fun_jaxpr")))
                outs = run(body.jaxpr, body.consts, vals) if hasattr(body, "consts") else run(body, (), vals)
            else:
                if name in ("scan", "while", "cond", "shard_map"):
                    raise NotImplementedError(f"{name}: a sub-jaxpr (loops are not emulated here)")
                bp = eqn.primitive.get_bind_params(params)
                if isinstance(bp, tuple):
                    bp = bp[1]
                o = eqn.primitive.bind(*vals, **bp)
                outs = o if eqn.primitive.multiple_results else [o]
            env.update((v, x) for v, x in zip(eqn.outvars, outs) if type(v).__name__ != "DropVar")
        return [read(v) for v in jaxpr.outvars]

    @functools.wraps(fn)
    def wrapped(*args: Any) -> Any:
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = run(closed.jaxpr, closed.consts, list(jax.tree_util.tree_leaves(args)))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs)

    return wrapped


def emulating_policy() -> Any:
    """A context in which ``precision.apply(fn, "bf16")`` computes each bfloat16 value in float32
    and rounds it to bfloat16 (the policy's storage, float32's arithmetic)."""
    import contextlib

    import jax.numpy as jnp

    from synkhronos import jaxpr_policy as precision  # the interpreter of synkhronos.precision's policies

    @contextlib.contextmanager
    def ctx() -> Any:
        bind, product = precision._bind, precision._product

        def f32_bind(eqn: Any, invals: list[Any], policy: str) -> list[Any]:
            if policy == "bf16" and any(precision._is_bf16(x) for x in invals) \
                    and eqn.primitive.name in precision._BF16_OPS \
                    and eqn.primitive.name != "convert_element_type":
                ups = [x.astype(jnp.float32) if precision._is_bf16(x) else x for x in invals]
                outs = bind(eqn, ups, policy)
                return [y.astype(jnp.bfloat16) if y.dtype == jnp.float32 else y for y in outs]
            return bind(eqn, invals, policy)

        def f32_product(eqn: Any, invals: list[Any], policy: str) -> Any:
            if policy == "bf16" and jnp.dtype(eqn.outvars[0].aval.dtype) == jnp.float32:
                lhs, rhs = (rounded(x.astype(jnp.float32)) for x in invals[:2])
                return product(eqn, [lhs, rhs, *invals[2:]], "highest").astype(jnp.bfloat16)
            return product(eqn, invals, policy)

        precision._bind, precision._product = f32_bind, f32_product
        try:
            yield
        finally:
            precision._bind, precision._product = bind, product

    return ctx()


def without_ops(ops: set[str]) -> Any:
    """A context in which the ``"bf16"`` policy computes the primitives ``ops`` in float32."""
    import contextlib

    from synkhronos import jaxpr_policy as precision  # the interpreter of synkhronos.precision's policies

    @contextlib.contextmanager
    def ctx() -> Any:
        saved = precision._BF16_OPS
        precision._BF16_OPS = frozenset(saved - ops)
        try:
            yield
        finally:
            precision._BF16_OPS = saved

    return ctx()


def kind_of(name: str) -> str:
    if name.startswith("fc"):
        return "dense " + name.split(".")[-1]
    if name.endswith(".W"):
        return "conv W"
    return "bn " + name.split(".")[-1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import warnings

    import pytensor
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode
    from pytensor.link.jax.linker import JAXLinker

    from synk_lasagne import layers, objectives
    from synk_lasagne.models import build_resnet
    from synk_lasagne.random import set_rng
    from synkhronos import jaxpr_policy, precision

    warnings.filterwarnings("ignore")
    pytensor.config.floatX = "float32"
    set_rng(np.random.RandomState(args.seed))
    if args.smooth:
        from synk_lasagne import nonlinearities
        from synk_lasagne.models import resnet

        resnet.nonlinearities = type("Smooth", (), {"rectify": staticmethod(nonlinearities.softplus)})
        resnet.layers = type("Layers", (), {k: getattr(layers, k) for k in layers.__all__})
        resnet.layers.MaxPool2DLayer = functools.partial(layers.Pool2DLayer, mode="average_inc_pad")
    x, y = pt.tensor4("x", dtype="float32"), pt.ivector("y")
    net = build_resnet(args.depth, args.image, args.classes, args.width)
    probabilities = pt.special.softmax(layers.get_output(net, x), axis=-1)
    loss = objectives.aggregate(objectives.categorical_crossentropy(probabilities, y))
    params = layers.get_all_params(net, trainable=True)
    names = []
    for p in params:
        owner = next(lay for lay in layers.get_all_layers(net) if p in lay.params)
        names.append(p.name if p.name and "." in p.name else f"{owner.name or type(owner).__name__}.{p.name}")
    grads = pt.grad(loss, params)
    rng = np.random.default_rng(args.seed)
    data = (rng.standard_normal((args.batch, 3, args.image, args.image), dtype=np.float32),
            rng.integers(0, args.classes, args.batch).astype(np.int32))

    def compiled(transform: Callable[[Any], Any]) -> Any:
        linker = type("ProbeLinker", (JAXLinker,),
                      {"jit_compile": lambda self, fn: JAXLinker.jit_compile(self, transform(fn))})()
        mode = Mode(linker=linker, optimizer=precision.jax_mode("JAX", "highest").provided_optimizer)
        return pytensor.function([x, y], [loss, *grads], mode=mode)

    results = {}
    for variant in [v for v in args.variants.split(",") if v]:
        inputs = data
        if variant in ("fp32", "fp32b"):
            fn = pytensor.function([x, y], [loss, *grads], mode=precision.jax_mode("JAX", "highest"))
            if variant == "fp32b":
                import ml_dtypes
                inputs = (data[0].astype(ml_dtypes.bfloat16).astype(np.float32), data[1])
            results[variant] = fn(*inputs)
        elif variant in ("prod", "prod+out"):
            results[variant] = compiled(lambda f, r=variant == "prod+out": product_interpreter(f, r))(*inputs)
        elif variant == "emul":
            with emulating_policy():
                results[variant] = compiled(lambda f: precision.apply(f, "bf16"))(*inputs)
        elif variant.startswith("noise"):
            fn = pytensor.function([x, y], [loss, *grads], mode=precision.jax_mode("JAX", "highest"))
            scale = 2.0 ** -int(variant[5:])
            wobble = np.random.default_rng(args.seed + 1).uniform(-1, 1, data[0].shape)
            results[variant] = fn((data[0] * (1 + scale * wobble)).astype(np.float32), data[1])
        elif variant == "bf16" or variant.startswith("-"):
            ops = set(variant[1:].split("+")) if variant.startswith("-") else set()
            if ops == {"ALL"}:
                ops = set(jaxpr_policy._BF16_OPS)
            with without_ops(ops):
                results[variant] = compiled(lambda f: precision.apply(f, "bf16"))(*inputs)
        else:
            print(f"unknown variant {variant!r}", file=sys.stderr)
            return 2
    ref = results["fp32"]
    kinds = sorted({kind_of(n) for n in names})
    smooth = " (softplus, average pooling)" if args.smooth else ""
    print(f"ResNet-{args.depth}{smooth} width {args.width}, {args.image}x{args.image}, batch {args.batch}: relative "
          "gradient error |g - g_fp32| / |g_fp32| per kind of parameter, median / max over the parameters")
    print("| variant | loss rel. | " + " | ".join(kinds) + " | all (global) | cosine |")
    print("|---|---:|" + "---:|" * (len(kinds) + 2))
    for variant, res in results.items():
        errs = [float(np.linalg.norm(g - r) / np.linalg.norm(r)) for g, r in zip(res[1:], ref[1:])]
        cells = []
        for k in kinds:
            e = [err for err, n in zip(errs, names) if kind_of(n) == k]
            cells.append(f"{np.median(e):.2%} / {max(e):.2%}")
        total = np.sqrt(sum(np.sum((g - r) ** 2) for g, r in zip(res[1:], ref[1:])) /
                        sum(np.sum(r ** 2) for r in ref[1:]))
        flat, flat_ref = (np.concatenate([np.ravel(g) for g in r[1:]]) for r in (res, ref))
        cosine = float(flat @ flat_ref / np.linalg.norm(flat) / np.linalg.norm(flat_ref))
        print(f"| {variant} | {abs(res[0] - ref[0]) / abs(ref[0]):.2e} | " + " | ".join(cells)
              + f" | {total:.2%} | {cosine:.4f} |")
        if args.per_param:
            for n, err in zip(names, errs):
                print(f"    {n}: {err:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
