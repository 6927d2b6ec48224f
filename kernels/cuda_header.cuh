// CUDA prelude (header part): the helpers the shared kernel bodies call, spelled for CUDA.
// MB_DEV is Metal's `device` address space; CUDA has one global space, so it is empty here.
#define MB_DEV

__device__ __forceinline__ float mb_lane_sum(float v) {
  // Butterfly over the 32 lanes of a full warp: every lane ends with the same, fixed-order sum.
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
// Precise expf, not __expf: the fused path must stay within the reference's rounding class.
__device__ __forceinline__ float mb_exp(float v) { return expf(v); }
__device__ __forceinline__ float mb_nan() { return __int_as_float(0x7fffffff); }
