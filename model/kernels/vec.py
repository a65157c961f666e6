"""Sixteen float32 lanes as one value: the few LLVM vector operations the product kernels need.

numba's loops over a small output tile stay scalar here (LLVM fully unrolls the 16-lane loop, then
cannot prove the local accumulators do not alias the weights, and numba leaves the SLP vectoriser
off), so the kernels spell their vectors out: :data:`f32x16` is an LLVM ``<16 x float>`` and each
function below emits one plain IR instruction per lane-wise step. Lanes are always *different
output rows*; no operation here mixes lanes. Arithmetic is ``fmul`` / ``fadd`` with no fast-math
flags, so LLVM neither reassociates nor contracts it, and the explicit ``llvm.fma`` (one rounding,
where the kernels ask for it); LLVM splits the 16 lanes into whatever the CPU has (one zmm, two ymm,
four xmm) without changing any lane's bits.

The integer-to-float conversions are exact: every value converted (a nibble, an int8, a 16-bit
pattern's 10-bit mantissa) fits float32's 24-bit significand.

Source: the LLVM Language Reference (``fadd``, ``fmul``, ``llvm.fma``, ``uitofp``, ``sitofp``, vector types;
fast-math flags are opt-in); IEEE 754 binary16 / binary32 encodings.
"""

from __future__ import annotations

from model.kernels.jit import numba  # noqa: F401  (first: it sets numba's environment)

# isort: split
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, models, register_model

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_VF = ir.VectorType(_F32, LANES)
_VI = ir.VectorType(_I32, LANES)


class F32x16(types.Type):
    """numba's type of a ``<16 x float>`` value (16 output rows' partial sums)."""

    def __init__(self) -> None:
        super().__init__(name="f32x16")


f32x16 = F32x16()


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):  # noqa: ANN001  (numba's hook)
        super().__init__(dmm, fe_type, _VF)


def _splat_i32(value: int) -> ir.Constant:
    return ir.Constant(_VI, [value] * LANES)


def _load(context, builder, aryty, ary, idx, width: int):  # noqa: ANN001, ANN202
    """Load ``LANES`` consecutive elements ``ary[idx : idx + LANES]`` (no bounds check)."""
    arr = context.make_array(aryty)(context, builder, ary)
    ptr = cgutils.gep_inbounds(builder, arr.data, idx)
    vty = ir.VectorType(ir.IntType(width) if width else _F32, LANES)
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


@intrinsic
def zeros(typingctx):  # noqa: ANN001, ANN201
    """Return 16 lanes of +0.0."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return ir.Constant(_VF, [0.0] * LANES)

    return f32x16(), codegen


@intrinsic
def splat(typingctx, value):  # noqa: ANN001, ANN201
    """Return a float32 scalar in all 16 lanes."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        undef = ir.Constant(_VF, ir.Undefined)
        one = builder.insert_element(undef, args[0], ir.Constant(_I32, 0))
        return builder.shuffle_vector(one, undef, ir.Constant(_VI, [0] * LANES))

    return f32x16(types.float32), codegen


def _binary(op: str):  # noqa: ANN202
    @intrinsic
    def fn(typingctx, a, b):  # noqa: ANN001, ANN202
        if a != f32x16 or b != f32x16:
            return None

        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            return getattr(builder, op)(args[0], args[1])  # no fast-math flags

        return f32x16(f32x16, f32x16), codegen

    return fn


add = _binary("fadd")
mul = _binary("fmul")


@intrinsic
def fma(typingctx, a, b, c):  # noqa: ANN001, ANN201
    """Return ``a * b + c`` in each lane, rounded once (IEEE 754 fusedMultiplyAdd).

    ``llvm.fma`` is the exact operation on every target: one instruction where the CPU has FMA
    (every x86-64 since Haswell and Piledriver), else a call to the C library's ``fmaf``, which is
    correctly rounded too: the same bits, slower.
    """
    if a != f32x16 or b != f32x16 or c != f32x16:
        return None

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        fnty = ir.FunctionType(_VF, [_VF, _VF, _VF])
        fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.v{LANES}f32")
        return builder.call(fn, list(args))

    return f32x16(f32x16, f32x16, f32x16), codegen


@intrinsic
def load_f32(typingctx, ary, idx):  # noqa: ANN001, ANN201
    """Return float32 ``ary[idx : idx + 16]`` (1-D C-contiguous)."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return _load(context, builder, sig.args[0], args[0], args[1], 0)

    return f32x16(ary, idx), codegen


@intrinsic
def store_f32(typingctx, ary, idx, value):  # noqa: ANN001, ANN201
    """Store 16 lanes at float32 ``ary[idx : idx + 16]`` (1-D C-contiguous, writable)."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.gep_inbounds(builder, arr.data, args[1])
        builder.store(args[2], builder.bitcast(ptr, _VF.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(ary, idx, f32x16), codegen


@intrinsic
def load_nibbles(typingctx, ary, idx, high, bias):  # noqa: ANN001, ANN201
    """Return ``float32((byte & 15) - bias)`` (``high``: ``byte >> 4``) of uint8 ``ary[idx:idx+16]``."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        q = builder.zext(_load(context, builder, sig.args[0], args[0], args[1], 8), _VI)
        lo = builder.and_(q, _splat_i32(15))
        hi = builder.lshr(q, _splat_i32(4))
        q = builder.select(builder.trunc(args[2], ir.IntType(1)), hi, lo)
        undef = ir.Constant(_VI, ir.Undefined)
        b = builder.insert_element(undef, builder.trunc(args[3], _I32), ir.Constant(_I32, 0))
        b = builder.shuffle_vector(b, undef, ir.Constant(_VI, [0] * LANES))
        return builder.sitofp(builder.sub(q, b), _VF)

    return f32x16(ary, idx, types.boolean, types.int64), codegen


@intrinsic
def load_i8(typingctx, ary, idx):  # noqa: ANN001, ANN201
    """Return int8 ``ary[idx : idx + 16]`` widened to float32."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return builder.sitofp(_load(context, builder, sig.args[0], args[0], args[1], 8), _VF)

    return f32x16(ary, idx), codegen


@intrinsic
def load_bf16(typingctx, ary, idx):  # noqa: ANN001, ANN201
    """Return bfloat16 bit patterns uint16 ``ary[idx : idx + 16]`` widened to float32."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        h = builder.zext(_load(context, builder, sig.args[0], args[0], args[1], 16), _VI)
        return builder.bitcast(builder.shl(h, _splat_i32(16)), _VF)

    return f32x16(ary, idx), codegen


@intrinsic
def load_f16(typingctx, ary, idx):  # noqa: ANN001, ANN201
    """Return IEEE binary16 bit patterns uint16 ``ary[idx : idx + 16]`` widened to float32.

    Integer operations and a select, no F16C instruction, so the same code runs on any x86-64:
    normal values re-bias the exponent (``+ (127 - 15) << 23``), infinities and NaNs get the
    all-ones exponent, subnormals are ``mantissa * 2**-24`` (exact in float32).
    """

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        h = builder.zext(_load(context, builder, sig.args[0], args[0], args[1], 16), _VI)
        sign = builder.shl(builder.and_(h, _splat_i32(0x8000)), _splat_i32(16))
        em = builder.and_(h, _splat_i32(0x7FFF))
        normal = builder.add(builder.shl(em, _splat_i32(13)), _splat_i32(0x38000000))
        special = builder.add(normal, _splat_i32(0x38000000))  # exponent 31 -> 255
        bits = builder.select(builder.icmp_unsigned(">=", em, _splat_i32(0x7C00)), special, normal)
        sub = builder.fmul(builder.sitofp(em, _VF), ir.Constant(_VF, [2.0**-24] * LANES))
        mag = builder.select(
            builder.icmp_unsigned("<", em, _splat_i32(0x400)), sub, builder.bitcast(bits, _VF)
        )
        return builder.bitcast(builder.or_(builder.bitcast(mag, _VI), sign), _VF)

    return f32x16(ary, idx), codegen


_I64 = ir.IntType(64)


@intrinsic
def div(typingctx, a, b):  # noqa: ANN001, ANN201
    """Return ``a / b`` in each lane (IEEE ``fdiv``, correctly rounded)."""
    if a != f32x16 or b != f32x16:
        return None

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return builder.fdiv(args[0], args[1])

    return f32x16(f32x16, f32x16), codegen


@intrinsic
def maximum(typingctx, a, b):  # noqa: ANN001, ANN201
    """Return ``a if a > b else b`` in each lane: one of the two inputs, exactly (a select)."""
    if a != f32x16 or b != f32x16:
        return None

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return f32x16(f32x16, f32x16), codegen


@intrinsic
def fma1(typingctx, a, b, c):  # noqa: ANN001, ANN201
    """Return the float32 scalar ``a * b + c`` rounded once: one lane of :func:`fma`."""
    if a != types.float32 or b != types.float32 or c != types.float32:
        return None

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        fnty = ir.FunctionType(_F32, [_F32, _F32, _F32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.f32")
        return builder.call(fn, list(args))

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def transpose16(typingctx, src, i, si, dst, j, sj):  # noqa: ANN001, ANN201
    """Copy a 16x16 float32 block transposed: ``dst[j + a sj + b] = src[i + b si + a]``.

    ``src`` and ``dst`` are C-contiguous float32 arrays of any rank indexed flat from their first
    element (no bounds check). Sixteen row loads, four stages of two-input shuffles (stage ``k``
    exchanges bit ``k`` of the row and column indices), sixteen stores: no arithmetic, so the
    copy is exact on every CPU.
    """
    ints = (i, si, j, sj)
    if not all(isinstance(x, types.Integer) for x in ints):
        return None

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        s_ary = context.make_array(sig.args[0])(context, builder, args[0])
        d_ary = context.make_array(sig.args[3])(context, builder, args[3])
        i0, s0, j0, t0 = (
            context.cast(builder, args[n], sig.args[n], types.int64) for n in (1, 2, 4, 5)
        )
        rows = []
        for b in range(LANES):
            idx = builder.add(i0, builder.mul(s0, ir.Constant(_I64, b)))
            ptr = builder.bitcast(cgutils.gep_inbounds(builder, s_ary.data, idx), _VF.as_pointer())
            rows.append(builder.load(ptr, align=1))
        for k in range(4):
            bit = 1 << k
            lo = [c if not c & bit else LANES + (c ^ bit) for c in range(LANES)]
            hi = [c ^ bit if not c & bit else LANES + c for c in range(LANES)]
            new = list(rows)
            for r in range(LANES):
                if not r & bit:
                    a, b = rows[r], rows[r | bit]
                    new[r] = builder.shuffle_vector(a, b, ir.Constant(_VI, lo))
                    new[r | bit] = builder.shuffle_vector(a, b, ir.Constant(_VI, hi))
            rows = new
        for a in range(LANES):
            idx = builder.add(j0, builder.mul(t0, ir.Constant(_I64, a)))
            ptr = builder.bitcast(cgutils.gep_inbounds(builder, d_ary.data, idx), _VF.as_pointer())
            builder.store(rows[a], ptr, align=1)
        return context.get_dummy_value()

    return types.void(src, i, si, dst, j, sj), codegen
