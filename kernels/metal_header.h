// Metal prelude (header part): the helpers the shared kernel bodies call.
// Thread indices are bound in metal_indices.inc, because MLX adds a Metal attribute parameter only
// when the attribute's name appears in the kernel *source*, not in its header.
#define MB_DEV device
#define MB_FN inline
// A thread's own memory (Metal's `thread` address space; CUDA names none).
#define MB_THREAD thread
// Memory one threadgroup shares (declared in the kernel body).
#define MB_SHARED threadgroup
// Unroll the next loop whole (its trip count a constant): a lane's loads of every step are then in flight together,
// not one memory round trip a step. The CPU shim names its own compiler's.
#ifndef MB_UNROLL
#define MB_UNROLL _Pragma("clang loop unroll(full)")
#endif

MB_FN float mb_lane_sum(float v) { return metal::simd_sum(v); }
MB_FN float mb_lane_max(float v) { return metal::simd_max(v); }
MB_FN uint32_t mb_lane_min(uint32_t v) { return metal::simd_min(v); }
// The value of lane (this lane ^ mask).
MB_FN float mb_lane_xor(float v, uint32_t mask) { return metal::simd_shuffle_xor(v, ushort(mask)); }
// Every thread of the threadgroup waits here; device-memory writes before it are visible after it.
MB_FN void mb_barrier() { metal::threadgroup_barrier(metal::mem_flags::mem_device); }
// The same, for writes to MB_SHARED memory.
MB_FN void mb_barrier_shared() { metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup); }
// Metal before MSL 3.2 has no device-scope fence: the strongest is this barrier, which orders device memory for
// the threadgroup only (and every thread of it must call it). So the Metal plan never sets FOLD (attn_decode.body,
// whose threadgroups would then read other threadgroups' partials unordered); these let the shared body compile.
MB_FN void mb_fence_device() { metal::threadgroup_barrier(metal::mem_flags::mem_device); }
// counter's value before this thread adds 1 to it, atomically.
MB_FN uint32_t mb_ticket(MB_DEV uint32_t* counter) {
  return metal::atomic_fetch_add_explicit((MB_DEV metal::atomic_uint*)counter, 1u, metal::memory_order_relaxed);
}
MB_FN float mb_exp(float v) { return metal::exp(v); }
MB_FN float mb_log(float v) { return metal::precise::log(v); }
MB_FN float mb_cos(float v) { return metal::precise::cos(v); }
MB_FN float mb_sin(float v) { return metal::precise::sin(v); }
MB_FN float mb_rsqrt(float v) { return 1.0f / metal::precise::sqrt(v); }
MB_FN float mb_nan() { return as_type<float>(0x7fc00000u); }
// The float whose IEEE-754 bits are v.
MB_FN float mb_as_float(uint32_t v) { return as_type<float>(v); }
MB_FN float mb_neg_inf() { return as_type<float>(0xff800000u); }
