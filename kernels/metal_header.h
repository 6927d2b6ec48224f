// Metal prelude (header part): the helpers the shared kernel bodies call.
// Thread indices are bound in metal_indices.inc, because MLX adds a Metal attribute parameter only
// when the attribute's name appears in the kernel *source*, not in its header.
#define MB_DEV device

inline float mb_lane_sum(float v) { return metal::simd_sum(v); }
inline float mb_exp(float v) { return metal::exp(v); }
inline float mb_nan() { return as_type<float>(0x7fc00000u); }
