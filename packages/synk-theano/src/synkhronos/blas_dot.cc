// synkhronos.blas's matrix product: an XLA FFI handler (a custom call of XLA:CPU) that computes
// C = op(A) op(B) with the process's BLAS (the gemm of numpy's OpenBLAS, whose address Python
// passes in), op being the identity or the transpose.  XLA's own CPU dot is Eigen's, about 20-30%
// slower on one core than OpenBLAS for the large float32 products of a training step
// (docs/guides/cpu.rst).
//
// A, B and C are row-major (XLA's default layout for a custom call's operands and result).
// The gemm has the CBLAS signature with 64-bit integers (ILP64: numpy's OpenBLAS), or 32-bit
// ones where `ilp64` is 0.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS's enums

template <typename T, typename Int>
using Gemm = void (*)(int, int, int, Int, Int, Int, T, const T*, Int, const T*, Int, T, T*, Int);

template <typename T, typename Int>
void CallGemm(int64_t gemm, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda,
              const T* b, int64_t ldb, T* c) {
  reinterpret_cast<Gemm<T, Int>>(gemm)(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans,
                                       Int(m), Int(n), Int(k), T(1), a, Int(lda), b, Int(ldb), T(0), c, Int(n));
}

template <typename T>
ffi::Error Product(ffi::AnyBuffer a, ffi::AnyBuffer b, T* c, int64_t gemm, bool ilp64, bool trans_a, bool trans_b) {
  auto da = a.dimensions(), db = b.dimensions();
  int64_t m = trans_a ? da[1] : da[0], k = trans_a ? da[0] : da[1], n = trans_b ? db[0] : db[1];
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {  // an empty sum: zeros (a BLAS may reject the leading dimension 0 of an empty operand)
    std::memset(c, 0, sizeof(T) * m * n);
    return ffi::Error::Success();
  }
  if (ilp64) {
    CallGemm<T, int64_t>(gemm, trans_a, trans_b, m, n, k, a.typed_data<T>(), da[1], b.typed_data<T>(), db[1], c);
  } else {
    CallGemm<T, int32_t>(gemm, trans_a, trans_b, m, n, k, a.typed_data<T>(), da[1], b.typed_data<T>(), db[1], c);
  }
  return ffi::Error::Success();
}

ffi::Error Dot(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> c, int64_t gemm, int64_t ilp64,
               int64_t trans_a, int64_t trans_b) {
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2 || a.element_type() != b.element_type()) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "synkhronos BLAS dot: two matrices of one dtype only");
  }
  switch (a.element_type()) {
    case ffi::DataType::F32: return Product<float>(a, b, c->typed_data<float>(), gemm, ilp64, trans_a, trans_b);
    case ffi::DataType::F64: return Product<double>(a, b, c->typed_data<double>(), gemm, ilp64, trans_a, trans_b);
    default: return ffi::Error(ffi::ErrorCode::kInvalidArgument, "synkhronos BLAS dot: float32 and float64 only");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SynkBlasDot, Dot,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("gemm")
                                  .Attr<int64_t>("ilp64")
                                  .Attr<int64_t>("trans_a")
                                  .Attr<int64_t>("trans_b"));
