// CUDA prelude (header part): the helpers the shared kernel bodies call, spelled for CUDA.
// MB_DEV is Metal's `device` address space; CUDA has one global space, so it is empty here.
#define MB_DEV
#define MB_FN __device__ __forceinline__
// Metal's `thread` address space: CUDA names none.
#define MB_THREAD
// Memory one block shares (declared in the kernel body).
#define MB_SHARED __shared__
// Unroll the next loop whole (its trip count a constant): a lane's loads of every step are then in flight together,
// not one memory round trip a step.
#define MB_UNROLL _Pragma("unroll")

// Butterflies over the 32 lanes of a full warp: every lane ends with the same, fixed-order result.
MB_FN float mb_lane_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
MB_FN float mb_lane_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}
MB_FN uint32_t mb_lane_min(uint32_t v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = min(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}
// Every thread of the block waits here; global-memory writes before it are visible after it.
MB_FN void mb_barrier() { __syncthreads(); }
// The same, for writes to MB_SHARED memory.
MB_FN void mb_barrier_shared() { __syncthreads(); }
// Orders this thread's memory accesses before the fence against those after it, for every thread of the GPU.
MB_FN void mb_fence_device() { __threadfence(); }
// counter's value before this thread adds 1 to it, atomically at device scope.
MB_FN uint32_t mb_ticket(MB_DEV uint32_t* counter) { return atomicAdd(counter, 1u); }
// The value of lane (this lane ^ mask).
MB_FN float mb_lane_xor(float v, uint32_t mask) { return __shfl_xor_sync(0xffffffffu, v, int(mask)); }
// Precise expf and logf, not __expf / __logf: the fused path must stay within the reference's rounding class.
MB_FN float mb_exp(float v) { return expf(v); }
MB_FN float mb_log(float v) { return logf(v); }
MB_FN float mb_cos(float v) { return cosf(v); }
MB_FN float mb_sin(float v) { return sinf(v); }
MB_FN float mb_rsqrt(float v) { return 1.0f / sqrtf(v); }
MB_FN float mb_nan() { return __int_as_float(0x7fffffff); }
// The float whose IEEE-754 bits are v.
MB_FN float mb_as_float(uint32_t v) { return __uint_as_float(v); }
MB_FN float mb_neg_inf() { return __uint_as_float(0xff800000u); }
