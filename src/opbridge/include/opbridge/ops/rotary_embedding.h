// Argument checks of rotary_embedding shared by its CPU and CUDA kernels, device
// checks included (device: kDLCPU or kDLCUDA; see check_device_like). Errors name
// the op and the argument. The positions' values are checked by each kernel.
//
// query and key may be rows at a stride (the op declares them row_strided): vLLM
// passes column slices of one qkv tensor. Their dims after the first must be
// contiguous; StridedRows (checks.h) locates each token's row.
//
// int32_rows: the kernel indexes within a token's row of query or key (heads *
// head_size elements) in int, as the CUDA kernel does; such a row must then hold
// at most 2^31 - 1 elements.
#pragma once

#include <opbridge/opbridge.h>

#include <cstdint>

namespace opbridge {
namespace rotary_embedding {

constexpr char kOp[] = "rotary_embedding";

// query / key layout against positions: (*P, heads * head_size) or (*P, heads, head_size).
// Returns the number of heads.
inline int64_t check_heads(const char* op, const char* arg, const TensorView& t, const TensorView& positions,
                           int64_t head_size, bool int32_rows) {
  const int pn = positions.ndim();
  bool lead = t.ndim() == pn + 1 || t.ndim() == pn + 2;
  for (int i = 0; lead && i < pn; ++i) lead = t.size(i) == positions.size(i);
  OPB_CHECK(lead, ValueError)
      << op << ": " << arg << " must have shape (*positions.shape, num_heads * head_size) or "
      << "(*positions.shape, num_heads, head_size) with positions.shape = " << opbridge::shape_str(positions)
      << ", got " << opbridge::shape_str(t);
  const int64_t last = t.size(t.ndim() - 1);
  int64_t heads;
  if (t.ndim() == pn + 1) {
    OPB_CHECK(last % head_size == 0, ValueError)
        << op << ": " << arg << "'s last dim (" << last << ") must be a multiple of head_size (" << head_size
        << "), got shape " << opbridge::shape_str(t);
    heads = last / head_size;
  } else {
    OPB_CHECK(last == head_size, ValueError)
        << op << ": " << arg << "'s last dim must be head_size (" << head_size << ") in the (..., num_heads, "
        << "head_size) layout, got shape " << opbridge::shape_str(t);
    heads = t.size(t.ndim() - 2);
  }
  OPB_CHECK(heads >= 1, ValueError) << op << ": " << arg << " must hold at least one head, got shape "
                                    << opbridge::shape_str(t);
  if (int32_rows) {
    OPB_CHECK(heads * head_size <= INT32_MAX, ValueError)
        << op << ": " << arg << " has " << heads * head_size
        << " elements per token; at most 2^31 - 1 are supported";
  }
  return heads;
}

// positions, query and cos_sin_cache: dtypes and shapes; positions and the cache contiguous.
// Returns query's number of heads.
inline int64_t check_query_and_cache(const char* op, const TensorView& positions, const TensorView& query,
                                     int64_t head_size, const TensorView& cos_sin_cache, bool int32_rows) {
  OPB_CHECK_DTYPE(op, positions, opbridge::kInt64, opbridge::kInt32);  // as Positions reads them
  OPB_CHECK_FLOATING(op, query);
  OPB_CHECK_SAME_DTYPE(op, cos_sin_cache, query);
  OPB_CHECK(positions.ndim() == 1 || positions.ndim() == 2, ValueError)
      << op << ": positions must have shape (num_tokens,) or (batch, seq), got "
      << opbridge::shape_str(positions);
  OPB_CHECK(head_size > 0, ValueError) << op << ": head_size must be > 0, got " << head_size;
  const int64_t num_heads = check_heads(op, "query", query, positions, head_size, int32_rows);
  OPB_CHECK_NDIM(op, cos_sin_cache, 2);
  const int64_t rot_dim = cos_sin_cache.size(1);
  OPB_CHECK(rot_dim % 2 == 0 && rot_dim >= 2 && rot_dim <= head_size, ValueError)
      << op << ": cos_sin_cache's last dim (rot_dim = [cos | sin] halves) must be even and in "
      << "[2, head_size = " << head_size << "], got shape " << opbridge::shape_str(cos_sin_cache);
  OPB_CHECK_CONTIGUOUS(op, positions);
  OPB_CHECK_CONTIGUOUS(op, cos_sin_cache);
  return num_heads;
}

// key, when given (its device already checked), against query; then that the tensors rotated in place
// overlap no other argument. Returns key's number of heads, 0 without key.
inline int64_t check_key_and_overlaps(const char* op, const TensorView& positions, const TensorView& query,
                                      const Optional<TensorView>& key, int64_t head_size,
                                      const TensorView& cos_sin_cache, int64_t num_heads, bool int32_rows,
                                      bool q_dense, StridedRows* k_rows) {
  int64_t num_kv_heads = 0;
  // positions and cos_sin_cache are contiguous (checked); query and key are each tested once
  const bool qd = q_dense;
  if (key.has_value()) {
    const TensorView& k = key.value();
    ::opbridge::check_same_dtype(op, "key", k, "query", query);
    num_kv_heads = check_heads(op, "key", k, positions, head_size, int32_rows);
    OPB_CHECK(num_heads % num_kv_heads == 0, ValueError)
        << op << ": query's number of heads (" << num_heads << ") must be a multiple of key's ("
        << num_kv_heads << ")";
    const bool kd = k.IsContiguous();
    *k_rows = strided_rows(op, "key", k, num_kv_heads * head_size, kd);  // its layout, before any overlap
    opbridge::check_disjoint(op, "key", k, "query", query, kd, qd);
    opbridge::check_disjoint(op, "key", k, "positions", positions, kd, true);
    opbridge::check_disjoint(op, "key", k, "cos_sin_cache", cos_sin_cache, kd, true);
  }
  opbridge::check_disjoint(op, "query", query, "positions", positions, qd, true);
  opbridge::check_disjoint(op, "query", query, "cos_sin_cache", cos_sin_cache, qd, true);
  return num_kv_heads;
}

// positions, int64 (torch's and vLLM's) or int32 (JAX's without x64), read as int64. The width is
// tested per read, a branch every thread takes alike, so each kernel is compiled once rather than
// once per width: a template over the index type made rotary_embedding.cc's object 1.6x larger
// and its compile 2.4 -> 3.2 s.
struct Positions {
  const void* data;
  bool wide;  // int64

  OPB_HOST_DEVICE int64_t operator[](int64_t t) const {
    return wide ? static_cast<const int64_t*>(data)[t] : int64_t(static_cast<const int32_t*>(data)[t]);
  }
  OPB_HOST_DEVICE Positions operator+(int64_t t) const {
    return wide ? Positions{static_cast<const int64_t*>(data) + t, true}
                : Positions{static_cast<const int32_t*>(data) + t, false};
  }
};

inline Positions positions_of(const TensorView& positions) {  // its dtype checked
  if (positions.dtype() == kInt64) return {data_ptr<const int64_t>(positions), true};
  return {data_ptr<const int32_t>(positions), false};
}

struct Dims {
  int64_t num_heads;     // query's
  int64_t num_kv_heads;  // key's; 0 without key
  int64_t max_position;  // cos_sin_cache's rows
  int64_t rot_dim;       // cos_sin_cache's width
  StridedRows q_rows;    // query's tokens
  StridedRows k_rows;    // key's tokens (query's without key)
};

// Every argument check of rotary_embedding (kOp), devices first (positions is the anchor).
inline Dims check_args(int device, const TensorView& positions, const TensorView& query,
                        const Optional<TensorView>& key, int64_t head_size, const TensorView& cos_sin_cache,
                        bool int32_rows) {
  const char* op = kOp;
  OPB_CHECK_DEVICE(op, positions, device);
  OPB_CHECK_DEVICE_LIKE(op, device, query, positions);
  OPB_CHECK_DEVICE_LIKE(op, device, cos_sin_cache, positions);
  const int64_t num_heads = check_query_and_cache(op, positions, query, head_size, cos_sin_cache, int32_rows);
  // Tokens are numbered as positions' elements: with 2-D positions, seq of them at each batch index.
  const bool q_dense = query.IsContiguous();
  const StridedRows q_rows = strided_rows(op, "query", query, num_heads * head_size, q_dense);  // before overlaps
  StridedRows k_rows = q_rows;
  if (key.has_value()) ::opbridge::check_device_like(op, device, "key", key.value(), "positions", positions);
  const int64_t num_kv_heads = check_key_and_overlaps(op, positions, query, key, head_size, cos_sin_cache,
                                                      num_heads, int32_rows, q_dense, &k_rows);
  return Dims{num_heads, num_kv_heads, cos_sin_cache.size(0), cos_sin_cache.size(1), q_rows, k_rows};
}

}  // namespace rotary_embedding
}  // namespace opbridge
