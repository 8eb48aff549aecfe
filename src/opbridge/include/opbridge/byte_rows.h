// Rows at a stride, in bytes: the layout of an op's row_strided arguments (vLLM's query and key,
// column slices of one qkv tensor), and the exact test of whether two such tensors share a byte.
// Plain C++ (no tvm-ffi, no framework), so that the kernels' checks (checks.h: row_stride,
// check_disjoint) and the C entries of NumPy and torch judge layouts and overlaps by one
// definition, the one call.layout.row_strided states in Python.
#pragma once

#include <algorithm>
#include <cstdint>

namespace opbridge {
namespace rows {

// A tensor's memory as `n` rows of `bytes` bytes each, `step` bytes apart, from address `begin`.
struct ByteRows {
  int64_t begin, n, bytes, step;
};

// The tensor of `ndim` dims `shape`, element `strides` (nullptr: compact row-major) and `item`
// bytes per element at address `begin`, as ByteRows: true when it is contiguous or rows at a
// stride (dims after the first C-contiguous, dims of size 1 at any stride; the first dim at a
// stride at least a row apart), false for any other layout.
inline bool of(int ndim, const int64_t* shape, const int64_t* strides, int64_t item, int64_t begin, ByteRows* r) {
  int64_t row = 1;
  for (int k = ndim - 1; k >= 1; --k) {
    if (strides != nullptr && shape[k] != 1 && strides[k] != row) return false;
    row *= shape[k];
  }
  const int64_t n = ndim == 0 ? 1 : shape[0];
  r->begin = begin;
  if (n <= 1 || row == 0 || strides == nullptr || strides[0] == row) {  // one block
    r->n = 1;
    r->bytes = r->step = n * row * item;
    return true;
  }
  if (strides[0] < row) return false;  // rows that overlap each other, or run backwards
  r->n = n;
  r->bytes = row * item;
  r->step = strides[0] * item;
  return true;
}

// Whether a kernel takes the tensor as an argument its op declares row_strided: contiguous, or of
// at least two dims and rows at a stride (a kernel's rows lie within the dims after the first).
inline bool accepts(int ndim, const int64_t* shape, const int64_t* strides) {
  ByteRows r;
  if (!of(ndim, shape, strides, 1, 0, &r)) return false;
  return r.n == 1 || ndim >= 2;
}

inline int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

// [begin, end) of every byte `r` covers.
inline int64_t end(const ByteRows& r) { return r.begin + (r.n - 1) * r.step + r.bytes; }

// Whether some byte of `a` is a byte of `b`. Empty tensors meet nothing.
inline bool meet(const ByteRows& a, const ByteRows& b) {
  if (a.bytes == 0 || b.bytes == 0 || end(a) <= b.begin || end(b) <= a.begin) return false;
  if (a.n == 1 && b.n == 1) return true;
  if (a.step == b.step) {
    // Row i of a meets row j of b iff -b.bytes < d + (j - i) step < a.bytes, d = b.begin - a.begin:
    // the smallest k = j - i above the lower bound must be below the upper one and in range.
    const int64_t d = b.begin - a.begin;
    const int64_t k = std::max(floor_div(-b.bytes - d, a.step) + 1, -(a.n - 1));
    return k <= b.n - 1 && d + k * a.step < a.bytes;
  }
  const ByteRows& x = a.n <= b.n ? a : b;  // each row of the one with fewer against the other's near it
  const ByteRows& y = a.n <= b.n ? b : a;
  for (int64_t i = 0; i < x.n; ++i) {
    const int64_t s = x.begin + i * x.step;
    const int64_t lo = std::max<int64_t>(floor_div(s - y.bytes - y.begin, y.step) + 1, 0);
    const int64_t hi = std::min<int64_t>(-floor_div(-(s + x.bytes - y.begin), y.step) - 1, y.n - 1);
    if (lo <= hi) return true;
  }
  return false;
}

}  // namespace rows
}  // namespace opbridge
